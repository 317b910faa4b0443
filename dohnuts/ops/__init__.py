"""Kernels: fused on CUDA, a plain-PyTorch reference beside each, and the host-side plans they walk.

`kernels` dispatches: the rest of dohnuts calls it. Each op family keeps its Triton kernel
beside its reference: `norm/`, `conv/` and `swiglu/` (`fused`, `naive`), `delta_rule/`
(`rows`, `scan`, `backward`, `chunk`, `naive`), `attention`, `lora`. `backends` loads FLA and
our Triton kernels and records slow paths; `derived_cache` keeps constants of frozen weights;
`plain` and `triton_common` hold what the references and the kernels share; `plan` the plans.

A leaf: nothing here imports the rest of dohnuts.
"""
