"""Serving: the /v1/systemone front ends, their engines, the supervisor, the wire format and
batch prediction."""
