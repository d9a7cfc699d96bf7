"""The folder `runbus run` puts first on its command's PYTHONPATH, for its sitecustomize.py.

Imported as runbus.producer.boot (by tools that walk the package) its modules do nothing: the
hook acts only when Python imports it as `sitecustomize` at interpreter start.
"""
