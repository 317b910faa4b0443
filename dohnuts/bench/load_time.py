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
from pathlib import Path

import torch

STEPS = ("read", "bucket graphs", "vision graphs", "warm-up", "first request")


def load_steps(checkpoint: str, device: str, settings: tuple[str, ...] = ()) -> dict:
    """Seconds of each of `STEPS` as an engine process loads `checkpoint` on `device`, the runtime's
    `settings` changed first (`bench.settings`, as "graphs.WARM_UPS=1"): the
    deployable folder read (every hash checked) and moved there; the shape buckets' CUDA graphs;
    the vision tower's; the engine's warm-up (`Engine.warm_up`); one small request, as the
    engine process sends itself (`engine_process.warm_up`). With how many Triton kernel variants
    each step compiled, the buckets ready and the device memory reserved."""
    from ..ops.compiles import kernel_variants
    from ..runtime.checkpoint import load_engine
    from ..runtime.engine import Engine
    from ..runtime.engine_process import warm_up
    from ..runtime.vision_graphs import vision_buckets
    from .settings import apply

    chosen = apply(settings)
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
        before = kernel_variants()["compiled"]
        start = time.perf_counter()
        step()
        if where.type == "cuda":
            torch.cuda.synchronize(where)
        seconds[name] = time.perf_counter() - start
        compiled[name] = kernel_variants()["compiled"] - before
    engine = state["engine"]
    return {"settings": chosen, "seconds": seconds, "total_seconds": sum(seconds.values()), "triton_compiles": compiled,
            "buckets": len(engine.scores.buckets), "failed_bucket_captures": engine.scores.stats["failed"],
            "reserved_gib": torch.cuda.memory_reserved(where) / 2**30 if where.type == "cuda" else 0.0}


def load_time_record(checkpoint: Path, device: str, runs: int = 2, cache: Path | None = None,
                     settings: tuple[str, ...] = ()) -> dict:
    """`runs` loads of `checkpoint` on `device` under `settings`, each in a new process (`load_steps`) sharing
    Triton's kernel cache `cache` (a new folder by default): the first cold when that folder
    starts empty, the others warm.

    Raises:
        RuntimeError: a load failed; its output says why.
    """
    results = []
    with tempfile.TemporaryDirectory() as made:
        folder = Path(cache) if cache is not None else Path(made) / "triton"
        cold = not folder.exists() or not any(folder.iterdir())
        environment = {**os.environ, "TRITON_CACHE_DIR": str(folder)}
        code = ("import json, sys; from dohnuts.bench.load_time import load_steps; "
                "print(json.dumps(load_steps(sys.argv[1], sys.argv[2], tuple(sys.argv[3:]))))")
        for run in range(runs):
            done = subprocess.run([sys.executable, "-c", code, str(checkpoint), device, *settings], env=environment,
                                  capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"load {run + 1} of {runs} failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            result["kernel_cache"] = "cold" if cold and run == 0 else "warm"
            results.append(result)
    return {"workload": "load_time", "device": device, "runs": results}


def load_time_measurement(runs: int = 2, checkpoint: str | None = None, out: str | None = None,
                          settings: tuple[str, ...] = ()) -> None:
    """Load times of the shape-only Qwen3.5-0.8B deployable (written to a temporary folder unless
    `checkpoint` names one) on this machine's first CUDA device, or the CPU without one: `runs`
    engine loads in processes of their own, the first with Triton's kernel cache empty, each with
    the runtime's `settings` changed first (`bench.settings`).

        python benchmarks/run.py load_time --runs 2 --out load.json

    Prints a line a load; the record as JSON to `out`."""
    from ..io import read_json, write_json
    from ..runtime.checkpoint import SETTINGS
    from .shapes import write_shape_checkpoint

    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as made:
        folder = Path(checkpoint) if checkpoint is not None else write_shape_checkpoint("qwen3_5-0.8b",
                                                                                         Path(made) / "shape")
        record = load_time_record(folder, device, runs, settings=tuple(settings))
        # The ledger's label: a shape-only deployable names its shape (`write_shape_checkpoint`).
        record["shape_only"] = read_json(folder / SETTINGS)["resolved"].get("shape-only")
    for result in record["runs"]:
        steps = ", ".join(f"{name} {seconds:.1f} s ({result['triton_compiles'][name]} compiled)"
                          for name, seconds in result["seconds"].items())
        print(f"{result['kernel_cache']} kernel cache: {result['total_seconds']:.1f} s: {steps}; "
              f"{result['buckets']} buckets ({result['failed_bucket_captures']} failed), "
              f"{result['reserved_gib']:.1f} GiB reserved", flush=True)
    if out is not None:
        write_json(Path(out), record)
