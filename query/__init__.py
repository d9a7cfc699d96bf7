"""Reads for people, over storage's Store: what a run holds, shaped to be looked at.

storage/ is the store alone (its interface, rules, backends, rollups); this package presents
what it reads: the text and JSON tables of the read commands (`tables`, `documents`), `runbus
runs`, `show`, `metrics` and `logs` (`cli`), `runbus export` (`export`), and `runbus.Api`
(`notebook`) with the pandas tables it and `export` build (`frames`). It imports storage and
the core, never the producer, the ingester, the dashboard or the integrations.
"""
