"""The session API's verbs, by family; `core.daemon.Daemon` is all of them behind one dispatcher."""
