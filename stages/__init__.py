"""The DVC stage entry points: thin click commands, each run as `python -m stages.<name>`."""
