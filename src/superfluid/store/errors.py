"""The store's own failure, apart from any backend, so the daemon can refuse on it without importing one."""


class StoreError(RuntimeError):
    """The store did not answer in time, or refused a statement; nothing was written."""
