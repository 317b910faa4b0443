"""Checkpoint selection: highest dev macro accuracy, ties to the earliest step."""

import pandas as pd

from dohnuts.pipeline.select import best_checkpoint


def test_best_checkpoint_takes_the_highest_and_breaks_ties_towards_the_earliest():
    table = pd.DataFrame({"checkpoint": ["c800", "c0", "c400", "c1200"], "step": [800, 0, 400, 1200],
                          "macro_accuracy": [0.7, 0.5, 0.7, 0.6]})
    assert best_checkpoint(table).step == 400


def test_a_run_that_never_improves_keeps_step_zero():
    table = pd.DataFrame({"checkpoint": ["a", "b", "c"], "step": [0, 400, 800], "macro_accuracy": [0.6, 0.6, 0.4]})
    assert best_checkpoint(table).step == 0
