"""`python -m superfluid` is the `superfluid` command."""

from .cli import main

raise SystemExit(main())
