"""What lets a person watch a daemon: the terminal monitor of `serve`, `superfluid top`, the browser UI.

The terminal views draw only from the Prometheus exposition `/metrics` serves (read in
process by `serve`, over HTTP by `top`), so a view and `/metrics` never disagree. The
browser UI is a static page (`web/`) that talks to the daemon over `/web/ws`.
"""
