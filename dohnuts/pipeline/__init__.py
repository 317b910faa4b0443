"""One module per pipeline stage, plus what only the stages use (schedule, the source reader).

Only the stage scripts in `stages/` and the `dohnuts` command import this wing.
"""
