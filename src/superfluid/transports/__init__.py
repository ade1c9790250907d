"""How clients reach the daemon: the unix socket, the HTTP listener, the browser's JSON and WebSocket, and who may."""
