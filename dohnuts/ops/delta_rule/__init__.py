"""The gated delta rule in our Triton kernels: short rows (`rows`), whole sequences (`scan`), the gradient (`backward`).

`parts` holds the building blocks they share. Nothing here is imported on import of the
package: the kernel modules need Triton.
"""
