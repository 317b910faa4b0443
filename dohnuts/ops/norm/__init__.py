"""RMSNorm and its fused variants (residual add, rotary embedding, gate): Triton (`fused`) and references (`naive`)."""
