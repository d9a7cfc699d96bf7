"""`python -m ingester` is the `runbus` command."""

from ingester.cli import main

raise SystemExit(main())
