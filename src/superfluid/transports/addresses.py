"""Listener addresses as flags give them: parsed and refused before anything heavy loads."""

from __future__ import annotations

LOOPBACK_HOSTS = ("127.0.0.1", "[::1]", "localhost")


def split_address(address: str) -> tuple[str, int]:
    """`host:port` (or `[v6]:port`) into its parts; ValueError when it is not one."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{address!r} is not an address: give HOST:PORT, such as 127.0.0.1:8453")
    return host.strip("[]"), int(port)


def parse_web_address(address: str, anywhere: bool = False) -> tuple[str, int]:
    """`127.0.0.1:PORT`, `[::1]:PORT` or `localhost:PORT`; anything else is refused, unless `anywhere`
    (daemons sharing a store, whose clients follow sessions from one to another)."""
    if anywhere:
        return split_address(address)
    host, sep, port = address.rpartition(":")
    if sep and host in LOOPBACK_HOSTS and (not port.isdigit() or int(port) > 65535):
        raise ValueError(f"--web {address!r} is refused: expected a port from 0 to 65535 after the host")
    if not sep or host not in LOOPBACK_HOSTS:
        raise ValueError(
            f"--web {address!r} is refused: the browser transport listens on loopback only; "
            "give 127.0.0.1:PORT, [::1]:PORT or localhost:PORT (any address is taken with --store, where "
            "daemons on several machines serve one store)"
        )
    return host.strip("[]"), int(port)


def reachable(url: str) -> str:
    """A listener's URL as other machines reach it: a wildcard bind (0.0.0.0, ::) named by this host."""
    scheme, _, rest = url.partition("://")
    host, _, port = rest.rpartition(":")
    if host.strip("[]") in ("0.0.0.0", "::", ""):
        import socket

        return f"{scheme}://{socket.getfqdn()}:{port}"
    return url
