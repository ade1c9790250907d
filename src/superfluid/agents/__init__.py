"""Coding agents run against the daemon: the table of those `superfluid launch` knows, and the launcher."""
