"""How clients reach the daemon: the unix socket, and HTTP/WebSocket with --web."""
