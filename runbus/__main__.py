"""`python -m runbus` is the `runbus` command."""

from runbus.cli import main

raise SystemExit(main())
