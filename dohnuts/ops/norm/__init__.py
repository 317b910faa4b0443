"""RMSNorm and its fused variants (residual addition, rotary embedding, gate): the Triton kernels (`fused`)."""
