"""The DVC stage entry points: thin click commands, each run as `python -m stages.<name>`."""

import functools

import click

# What a stage reports as one clear line instead of a traceback: bad input or configuration
# (ValueError, TypeError; dohnuts' ConfigError and IntegrityError are ValueErrors), a missing
# input, an output folder it will not overwrite, a non-finite loss.
USER_ERRORS = (ValueError, TypeError, FileNotFoundError, FileExistsError, FloatingPointError, ArithmeticError)


def user_errors(command):
    """Run a stage command, turning USER_ERRORS into click's one-line error (exit status 1)."""
    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except USER_ERRORS as error:
            raise click.ClickException(f"{type(error).__name__}: {error}") from None
    return run
