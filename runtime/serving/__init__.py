"""Global rank 0's front door: WebSocket + HTTP server, wire format, ingress (prepare, route, lanes), metrics."""
