"""The gated delta rule: Triton kernels (`rows`, `scan`, `backward`, from `parts`) and plain PyTorch (`naive`).

Importing the package imports none of them: the kernel modules need Triton, the references do not.
"""
