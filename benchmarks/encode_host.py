"""The host's part of a request with no device involved: validation, the template, the packing
into a batch and the answers from given logits, for one benchmark workload, with Qwen3.5's real
tokenizer (its pieces cached, as in a warm predictor). The script behind the
`*-encode-host-*.txt` files in docs/results/.

    python3 benchmarks/encode_host.py distinct_text_50q

Prints the median of each step over `blocks` blocks of 300 calls, and the smallest block median
(the host is noisy: compare two commits by running this script alternately under each).
"""

import statistics
import sys
import time

import numpy as np

from dohnuts.bench.protocol import workloads
from dohnuts.config import ModelConfig
from dohnuts.inputs.template import Template
from dohnuts.inputs.vocabulary import qwen3_5_tokenizer
from dohnuts.model.base import new_image_processor
from dohnuts.runtime.predict import answers_of
from dohnuts.schema import parse_request


def block_median(call, calls: int = 300) -> float:
    """Median microseconds of `calls` calls, after 20 untimed ones."""
    for _ in range(20):
        call()
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return 1e6 * statistics.median(samples)


def main(name: str = "distinct_text_50q", blocks: int = 5) -> None:
    config = ModelConfig(base="shape-only", revision="random-weights", dtype="bfloat16", image_pixels=512 * 512)
    template = Template(qwen3_5_tokenizer(), new_image_processor(16, 512 * 512), config.marker_token)
    state, questions = workloads()[name]
    request = parse_request(state, questions, template.reserved)
    rows = template.encode(request, config.max_tokens)
    batch = template.collate(rows, [])
    logits = np.random.default_rng(0).standard_normal(tuple(batch.markers.shape)).astype(np.float32)
    mask = batch.candidate_mask.numpy()

    temperatures = {"choice": 1.0, "noul": 1.0, "score": 1.0}
    steps = {
        "parse": lambda: parse_request(state, questions, template.reserved),
        "template": lambda: template.encode(request, config.max_tokens),
        "pack": lambda: template.collate(rows, []),
        "encode (all three)": lambda: template.collate(
            template.encode(parse_request(state, questions, template.reserved), config.max_tokens), []),
        "answers": lambda: answers_of(logits, mask, [request], [batch.input_tokens], temperatures),
    }
    medians = {step: [] for step in steps}
    for _ in range(blocks):
        for step, call in steps.items():
            medians[step].append(block_median(call))
    print(f"## {name}: {len(rows)} rows, {batch.computed_tokens} computed tokens; us per call")
    for step, values in medians.items():
        print(f"{step:20s} median {statistics.median(values):8.1f}  smallest block {min(values):8.1f}")


if __name__ == "__main__":
    main(*sys.argv[1:2])
