"""The HTTP API: FastAPI routers, wire schemas, and the one table that maps errors to status codes."""
