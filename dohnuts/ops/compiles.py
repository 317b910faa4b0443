"""What Triton has compiled and tuned in this process, so that a request can be shown to add
nothing: after load, a compile or an autotune on a user's request is a stall of seconds
(issue 37). The benchmark counts them around its timed calls; a GPU test after load.
"""

from __future__ import annotations

import sys

# The packages whose Triton kernels a forward may launch: ours, and FLA's (training's long sequences).
PACKAGES = ("dohnuts", "fla")


def _kernels():
    """(kernel, is_jit) for each Triton kernel interface of the loaded `PACKAGES` modules: the
    JIT functions, and the autotuners among the wrappers around them."""
    try:
        from triton.runtime.autotuner import Autotuner, Heuristics
        from triton.runtime.jit import JITFunction
    except ImportError:
        return
    seen: set[int] = set()
    for name, module in list(sys.modules.items()):
        if module is None or name.partition(".")[0] not in PACKAGES:
            continue
        for value in list(vars(module).values()):
            while isinstance(value, JITFunction | Autotuner | Heuristics) and id(value) not in seen:
                seen.add(id(value))
                if isinstance(value, JITFunction):
                    yield value, True
                    break
                if isinstance(value, Autotuner):
                    yield value, False
                value = value.fn  # an autotuner or heuristics wraps another kernel interface


def kernel_variants() -> dict[str, int]:
    """{"kernels": the Triton kernels of the loaded `PACKAGES` modules, "compiled": the variants
    of them Triton holds in memory, "tuned": the argument keys their autotuners have tuned}:
    "compiled" and "tuned" grow by one for each compile or autotune. Zeros without Triton, or
    under its interpreter (which compiles nothing)."""
    kernels = compiled = tuned = 0
    for kernel, jit in _kernels():
        if jit:  # its caches: one per device, the kernels first
            kernels += 1
            compiled += sum(len(caches[0]) for caches in kernel.device_caches.values())
        else:
            tuned += len(kernel.cache)
    return {"kernels": kernels, "compiled": compiled, "tuned": tuned}


def compiled_keys() -> dict[str, set[str]]:
    """Each compiled kernel's name (module and function) and the keys of its compiled variants
    (Triton's specialisation of the arguments) or tuned configurations: what a test shows when a
    request compiles something (the difference of two calls names the kernel and the argument)."""
    found: dict[str, set[str]] = {}
    for kernel, jit in _kernels():
        function = kernel.fn if jit else kernel.base_fn
        name = f"{function.__module__}.{function.__name__}" + ("" if jit else " (tuned)")
        keys = ({str(key) for caches in kernel.device_caches.values() for key in caches[0]} if jit
                else {str(key) for key in kernel.cache})
        if keys:
            found.setdefault(name, set()).update(keys)
    return found
