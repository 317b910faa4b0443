"""One process of a distributed test run (started by torchrun from test_distributed.py).

    python -m torch.distributed.run --standalone --nproc-per-node N distributed_worker.py JOB JSON

JOB is train (a short run, `die_at` makes rank 1 exit at that update), select or test; JSON holds
the paths and settings. Every rank runs the same code; rank 0 writes the result file.
"""

import json
import os
import sys
from pathlib import Path

from dohnuts.config import LoraConfig, ModelConfig, SelectConfig, TestConfig, TrainConfig
from dohnuts.io import write_json


def main(job: str, settings: dict) -> None:
    if job == "train":
        from dohnuts.pipeline.train import TrainRun, train

        config = TrainConfig(steps=settings["steps"], eval_every=2, rows_per_microbatch=4, microbatches_per_update=4,
                             lora_lr=1e-3, head_lr=5e-3)
        run = TrainRun(ModelConfig(image_pixels=64 * 64), LoraConfig(), config, seed=3, base=Path(settings["base"]),
                       data=Path(settings["data"]), out=Path(settings["out"]))

        def die(update):
            if update == settings.get("die_at") and os.environ.get("RANK") == "1":
                os._exit(3)  # a rank killed mid-run

        trainer = train(run, resume=settings.get("resume", False), on_update=die)
        if trainer.place.main:
            write_json(Path(settings["result"]), {"log": trainer.log, "processes": trainer.place.size})
    elif job == "select":
        from dohnuts.pipeline.select import select

        out = Path(settings["out"])
        metrics = select(Path(settings["checkpoints"]), Path(settings["base"]), Path(settings["data"]),
                         ModelConfig(image_pixels=64 * 64), LoraConfig(), SelectConfig(batch_tokens=400),
                         out / "adapter", out / "selection.parquet", out / "curve")
        if metrics is not None:
            write_json(Path(settings["result"]), metrics)
    elif job == "test":
        from dohnuts.pipeline.test import test

        outputs = test(Path(settings["checkpoint"]), Path(settings["data"]), TestConfig(batch_tokens=400))
        if outputs is not None:
            write_json(Path(settings["result"]), {"metrics": outputs[1],
                                                  "probabilities": list(map(list, outputs[0].probabilities))})


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
