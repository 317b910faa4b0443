"""Kernels: fused on CUDA, a plain-PyTorch reference beside each, and the host-side plans they walk.

A leaf: nothing here imports the rest of dohnuts.
"""
