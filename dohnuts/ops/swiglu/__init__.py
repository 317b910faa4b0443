"""SwiGLU, silu(gate) * up, and the attention's output gate, x * sigmoid(gate): the Triton kernels
(`fused`) and their references (`naive`)."""
