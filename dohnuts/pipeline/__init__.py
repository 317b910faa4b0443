"""One module per pipeline stage, plus what only the stages use (schedule, evaluation).

Only the stage scripts in `stages/` import this wing.
"""
