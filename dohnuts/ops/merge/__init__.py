"""Attention over two sets of keys from each set's output and log-sum-exp: the Triton kernel
(`fused`) and its reference (`naive`)."""
