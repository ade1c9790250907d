"""`python -m superfluid` is the `superfluid` command."""

from .cli.main import main

raise SystemExit(main())
