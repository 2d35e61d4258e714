"""The front-end: WebSocket + HTTP server, wire format, admission, sessions, limits and metrics (either process)."""
