"""The `superfluid` command and its subcommands."""
