"""SwiGLU, silu(gate) * up: the Triton kernel (`fused`) and its reference (`naive`)."""
