"""SwiGLU, silu(gate) * up: the Triton kernel (`fused`)."""
