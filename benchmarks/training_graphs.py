"""The training update with and without training graphs, in one process: the script behind the
`h200-training-graphs-*.txt` files in docs/results/.

    python3 benchmarks/training_graphs.py [VARIED] [MODES] > training-graphs.txt

On shape-only Qwen3.5-0.8B models (random weights, bf16, the real tokenizer), each with fresh
LoRA, the benchmark's `training_update_record`: first with every update eager (the training
graphs' capture put out of reach), then as the runtime runs it (a training bucket's second
batch captures its graphs, later ones replay them), each with VARIED (default 16) more updates
of distinct layouts. MODES (default `eager,graphs`) picks either or both. Every timing is
bracketed by device synchronisations.
"""

import json
import sys

import torch

from dohnuts.bench.shapes import shape_only_predictor
from dohnuts.bench.telemetry import measure_ceilings
from dohnuts.bench.training import training_update_record


def main(varied: int, modes: str = "eager,graphs") -> None:
    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    for label, capture_at in (("eager", 10**9), ("graphs", None)):
        if label not in modes.split(","):
            continue
        predictor = shape_only_predictor("qwen3_5-0.8b", device, graphs=False)
        if capture_at is not None:
            predictor.model.training_graphs.capture_at = capture_at
        torch.cuda.reset_peak_memory_stats(device)
        records = training_update_record(predictor.model, predictor.template, ceilings, varied=varied)
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        repeated = records[0]
        samples = [round(x, 1) for x in repeated["samples_ms"]]
        print(f"{label}: update p50 {repeated['p50_ms']:.1f} ms, samples {samples}, "
              f"cold {repeated['cold_ms']:.0f} ms, computed tokens {repeated['computed_tokens']}, "
              f"graphs {repeated['training_graphs']}, peak allocated {peak:.1f} GiB", flush=True)
        for record in records[1:]:
            print(f"{label}: {record['updates']} varied layouts ({record['buckets']} buckets): p50 "
                  f"{record['p50_ms']:.1f} ms, p95 {record['p95_ms']:.1f}, mean {record['mean_ms']:.1f}, "
                  f"graphs {record['training_graphs']}", flush=True)
            print(json.dumps({key: record[key] for key in ("computed_tokens", "samples_ms")}), flush=True)
        del predictor, records
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 16, *sys.argv[2:3])
