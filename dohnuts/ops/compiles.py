"""What Triton has compiled and tuned in this process, so that a request can be shown to add
nothing: after load, a compile or an autotune on a user's request is a stall of seconds
(issue 37). The benchmark counts them around its timed calls; a GPU test after load.
"""

from __future__ import annotations

import sys

# The packages whose Triton kernels a forward may launch: ours, and FLA's (training's long sequences).
PACKAGES = ("dohnuts", "fla")


def kernel_variants() -> dict[str, int]:
    """{"kernels": the Triton kernels of the loaded `PACKAGES` modules, "compiled": the variants
    of them Triton holds in memory, "tuned": the argument keys their autotuners have tuned}:
    "compiled" and "tuned" grow by one for each compile or autotune. Zeros without Triton, or
    under its interpreter (which compiles nothing)."""
    try:
        from triton.runtime.autotuner import Autotuner, Heuristics
        from triton.runtime.jit import JITFunction
    except ImportError:
        return {"kernels": 0, "compiled": 0, "tuned": 0}
    seen: set[int] = set()
    kernels = compiled = tuned = 0
    for name, module in list(sys.modules.items()):
        if module is None or name.partition(".")[0] not in PACKAGES:
            continue
        for value in list(vars(module).values()):
            while isinstance(value, JITFunction | Autotuner | Heuristics) and id(value) not in seen:
                seen.add(id(value))
                if isinstance(value, JITFunction):  # its caches: one per device, the kernels first
                    kernels += 1
                    compiled += sum(len(caches[0]) for caches in value.device_caches.values())
                    break
                if isinstance(value, Autotuner):
                    tuned += len(value.cache)
                value = value.fn  # an autotuner or heuristics wraps another kernel interface
    return {"kernels": kernels, "compiled": compiled, "tuned": tuned}
