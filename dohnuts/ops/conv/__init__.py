"""The delta rule's causal convolution with its head split: the Triton kernel (`fused`) and its reference (`naive`)."""
