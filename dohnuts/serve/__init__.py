"""Serving: the /v1/systemone HTTP server, its batcher, the wire format and batch prediction."""
