"""What an operator collects from a running daemon beyond `/metrics`: the access log (a line per HTTP request
and per socket or WebSocket generation) and, with `--otlp-endpoint`, OpenTelemetry traces and metrics sent to
a collector. The OpenTelemetry SDK is imported only when an endpoint is set."""
