"""Serving: the /v1/systemone HTTP server and batch prediction (above the model wing)."""
