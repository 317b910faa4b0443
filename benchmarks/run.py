"""Run one named measurement of the registry, or list them.

    python benchmarks/run.py --list
    python benchmarks/run.py MEASUREMENT --help
    python benchmarks/run.py MEASUREMENT [--ARGUMENT VALUE ...]

The measurement imports the `dohnuts` on the path: the installed package, or the one PYTHONPATH
names (to compare two commits, run it under each). It prints its report on stdout; record figures
from it with `python benchmarks/ledger.py record`.
"""

from __future__ import annotations

import argparse
import inspect
import sys

import torch
from registry import MEASUREMENTS  # this folder is on the path when run as a script

from dohnuts.inputs.vocabulary import VocabularyMissing

# What a measurement reports as one line instead of a traceback: a bad argument (an unknown
# workload, for one) or the pinned Qwen3.5 vocabulary missing.
USER_ERRORS = (ValueError, VocabularyMissing)


def listing() -> str:
    """One line per measurement: name, what it needs, summary."""
    width = max(map(len, MEASUREMENTS))
    return "\n".join(f"{name:{width}s}  [{measurement.needs:4s}]  {measurement.summary}"
                     for name, measurement in MEASUREMENTS.items())


def parser() -> argparse.ArgumentParser:
    """The command line: --list, or a measurement's name and its arguments (`--name VALUE`)."""
    top = argparse.ArgumentParser(prog="run.py", description="Run one named measurement of benchmarks/registry.py.",
                                  epilog="measurements:\n" + listing(),
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    top.add_argument("--list", action="store_true", help="list the measurements and exit")
    names = top.add_subparsers(dest="measurement", metavar="MEASUREMENT")
    for name, measurement in MEASUREMENTS.items():
        one = names.add_parser(name, help=measurement.summary, description=inspect.getdoc(measurement.function),
                               epilog=f"needs: {measurement.needs}",
                               formatter_class=argparse.RawDescriptionHelpFormatter)
        for argument in measurement.arguments:
            default = argument.default if not argument.many else list(argument.default)
            one.add_argument(f"--{argument.name.replace('_', '-')}", dest=argument.name, type=argument.type,
                             nargs="+" if argument.many else None, required=argument.required,
                             default=None if argument.required else default,
                             help=argument.help + ("" if argument.required else " (default: %(default)s)"))
    return top


def main(argv: list[str] | None = None) -> int:
    arguments = parser().parse_args(argv)
    if arguments.list:
        print(listing())
        return 0
    if arguments.measurement is None:
        sys.exit(f"run.py: name a measurement; known: {', '.join(MEASUREMENTS)}")
    name = arguments.measurement
    measurement = MEASUREMENTS[name]
    if measurement.needs == "cuda" and not torch.cuda.is_available():
        sys.exit(f"run.py {name}: needs CUDA, and no CUDA device is available here")
    values = {argument.name: getattr(arguments, argument.name) for argument in measurement.arguments}
    values = {key: tuple(value) if isinstance(value, list) else value for key, value in values.items()}
    try:
        measurement.run(**values)
    except USER_ERRORS as error:
        sys.exit(f"run.py {name}: {type(error).__name__}: {error}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
