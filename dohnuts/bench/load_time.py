"""How long an engine takes to load, cold and warm (issue 37: "state load time cold and warm"):
the steps a server's engine process runs before it answers (`runtime.engine_process`), each
timed, in a process of its own, first with Triton's kernel cache empty, then with what the first
run left in it, as a server's first start on a machine and its restarts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

STEPS = ("read", "bucket graphs", "vision graphs", "warm-up", "first request")
RUN_SECONDS = 900  # a load's bound: a cold one on a fresh H200 took about two minutes


def cache_entries(folder: Path) -> int:
    """Entries of a Triton cache folder: one a kernel variant compiled (its hash's folder)."""
    return sum(1 for _ in folder.iterdir()) if folder.is_dir() else 0


def load_steps(checkpoint: str, device: str, settings: tuple[str, ...] = ()) -> dict:
    """Seconds of each of `STEPS` as an engine process loads `checkpoint` on `device`, the runtime's
    `settings` changed first (`bench.settings`, as "graphs.WARM_UPS=1"): the deployable folder
    read (every hash checked) and moved there; the shape buckets' CUDA graphs; the vision
    tower's; the engine's warm-up (`Engine.warm_up`, on CUDA); one small request, as the engine
    process sends itself (`engine_process.warm_up`). With the Triton kernels each step compiled
    (new entries in the cache folder `TRITON_CACHE_DIR` names; a kernel found there is loaded,
    not compiled), the buckets ready and the device memory reserved."""
    from ..runtime.checkpoint import load_engine
    from ..runtime.engine import Engine
    from ..runtime.engine_process import warm_up
    from ..runtime.vision_graphs import vision_buckets
    from .settings import apply

    chosen = apply(settings)
    cache = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    where = torch.device(device)
    if where.type == "cuda":
        torch.cuda.set_device(where)
    seconds, compiled = {}, {}
    state: dict = {}

    def read():
        model, _, pixels = load_engine(Path(checkpoint), where)
        text = model.backbone.config.text_config
        pad_id = text.pad_token_id if text.pad_token_id is not None else text.eos_token_id
        state.update(engine=Engine(model, pad_id=pad_id, image_pad_id=model.backbone.config.image_token_id),
                     model=model, pixels=pixels)

    def vision():
        pixels = state["pixels"]
        if pixels is not None:
            state["model"].vision_graphs.prepare(state["model"].backbone.visual,
                                                 vision_buckets(pixels.max_pixels, pixels.patch, pixels.merge))

    steps = {"read": read, "bucket graphs": lambda: state["engine"].scores.prepare(),  # nothing on the CPU
             "vision graphs": vision, "warm-up": lambda: where.type == "cuda" and state["engine"].warm_up(),
             "first request": lambda: warm_up(state["engine"])}
    for name, step in steps.items():
        before = cache_entries(cache)
        start = time.perf_counter()
        step()
        if where.type == "cuda":
            torch.cuda.synchronize(where)
        seconds[name] = time.perf_counter() - start
        compiled[name] = cache_entries(cache) - before
    engine = state["engine"]
    return {"settings": chosen, "seconds": seconds, "total_seconds": sum(seconds.values()),
            "triton_compiles": compiled, "buckets": len(engine.scores.buckets),
            "failed_bucket_captures": engine.scores.stats["failed_buckets"], "capture_failures": capture_failures(),
            "reserved_gib": torch.cuda.memory_reserved(where) / 2**30 if where.type == "cuda" else 0.0}


def capture_failures(shown: int = 5) -> list[dict]:
    """Why bucket captures failed in this process: each distinct error (`cuda_graphs` logs it as a
    slower path, `ops.backends.slow_paths`), its first 500 characters, with the count of buckets
    it stopped; the `shown` most frequent. (On 2026-12-07, 205 of 243 buckets failed on one error
    that a load's record did not show.)"""
    from collections import Counter

    from ..ops.backends import slow_paths

    errors = Counter(reason.partition("run eagerly: ")[2][:500] for key, reason in slow_paths().items()
                     if key.startswith("bucket-capture-"))
    return [{"error": error, "buckets": count} for error, count in errors.most_common(shown)]


def load_time_record(checkpoint: Path, device: str, runs: int = 2, cache: Path | None = None,
                     settings: tuple[str, ...] = (), on_run: Callable[[dict], None] | None = None,
                     seconds: float = RUN_SECONDS) -> dict:
    """`runs` loads of `checkpoint` on `device` under `settings`, each in a new process
    (`load_steps`) sharing Triton's kernel cache folder `cache` (a new one by default): a load is
    "cold" when it finds that folder empty, else "warm". Each load's result also holds
    `process_seconds`, its process's whole life (Python's start and the imports too), and goes
    to `on_run` as soon as it is known.

    Raises:
        RuntimeError: a load failed, gave no result or outlasted `seconds`; its output says why.
    """
    results = []
    with tempfile.TemporaryDirectory() as made:
        folder = Path(cache) if cache is not None else Path(made) / "triton"
        environment = {**os.environ, "TRITON_CACHE_DIR": str(folder)}
        code = ("import json, sys; from dohnuts.bench.load_time import load_steps; "
                "print(json.dumps(load_steps(sys.argv[1], sys.argv[2], tuple(sys.argv[3:]))))")
        for run in range(runs):
            cold = cache_entries(folder) == 0
            start = time.perf_counter()
            try:
                done = subprocess.run([sys.executable, "-c", code, str(checkpoint), device, *settings],
                                      env=environment, capture_output=True, text=True, timeout=seconds)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"load {run + 1} of {runs} took over {seconds:.0f} s") from None
            output = f"--- stdout\n{done.stdout[-2000:]}\n--- stderr\n{done.stderr[-4000:]}"
            if done.returncode != 0:
                raise RuntimeError(f"load {run + 1} of {runs} failed (exit code {done.returncode}):\n{output}")
            try:
                result = json.loads(done.stdout.strip().splitlines()[-1])
            except (IndexError, ValueError):
                raise RuntimeError(f"load {run + 1} of {runs} gave no result:\n{output}") from None
            result["process_seconds"] = time.perf_counter() - start
            result["kernel_cache"] = "cold" if cold else "warm"
            results.append(result)
            if on_run is not None:
                on_run(result)
    return {"workload": "load_time", "device": device, "runs": results}


def _line(result: dict) -> str:
    steps = ", ".join(f"{name} {seconds:.1f} s ({result['triton_compiles'][name]} compiled)"
                      for name, seconds in result["seconds"].items())
    return (f"{result['kernel_cache']} kernel cache: {result['total_seconds']:.1f} s of steps, "
            f"{result['process_seconds']:.1f} s of process: {steps}; {result['buckets']} buckets "
            f"({result['failed_bucket_captures']} failed), {result['reserved_gib']:.1f} GiB reserved"
            + "".join(f"\n  {failure['buckets']} failed on: {failure['error'][:300]}"
                      for failure in result.get("capture_failures", ())))


def load_time_measurement(runs: int = 2, checkpoint: str | None = None, out: str | None = None,
                          settings: tuple[str, ...] = ()) -> None:
    """Load times of the shape-only Qwen3.5-0.8B deployable (written to a temporary folder unless
    `checkpoint` names one) on this machine's first CUDA device, or the CPU without one: `runs`
    engine loads in processes of their own, the first with Triton's kernel cache empty, each with
    the runtime's `settings` changed first (`bench.settings`).

        python benchmarks/run.py load_time --runs 2 --out load.json

    Prints a line a load as it ends; the record as JSON to `out`."""
    from ..io import read_json, write_json
    from ..runtime.checkpoint import SETTINGS
    from .shapes import write_shape_checkpoint

    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as made:
        folder = Path(checkpoint) if checkpoint is not None else write_shape_checkpoint("qwen3_5-0.8b",
                                                                                         Path(made) / "shape")
        record = load_time_record(folder, device, runs, settings=tuple(settings),
                                  on_run=lambda result: print(_line(result), flush=True))
        # The ledger's label: a shape-only deployable names its shape (`write_shape_checkpoint`).
        record["shape_only"] = read_json(folder / SETTINGS)["resolved"].get("shape-only")
    if out is not None:
        write_json(Path(out), record)
