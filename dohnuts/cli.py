"""The `dohnuts` command: the data doctor, the `/v1/systemone` server, batch prediction, the
public mixture's sources.

The one module of the library that imports click: a console entry point, like the stage
scripts, above every wing.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from .config import read_params, section
from .data.doctor import describe, examine
from .io import write_json


@click.group()
def main():
    """Dohnuts: small multimodal decision models."""


@main.command()
@click.argument("path", type=click.Path(exists=True))
@click.option("--params", "params_path", type=click.Path(dir_okay=False), default="params.yaml", show_default=True,
              help="Parameters file for the partition seed and shares, the marker and the token budgets "
                   "(the defaults when it does not exist).")
@click.option("--base", type=click.Path(exists=True, file_okay=False), default=None,
              help="A base or checkpoint folder whose tokenizer measures token lengths (runs/prepare/base).")
@click.option("--report", type=click.Path(dir_okay=False), default=None, help="Also write the report as JSON.")
def doctor(path, params_path, base, report):
    """Check the decision records at PATH (a JSONL or Parquet file, or a folder of them) and
    report everything that would spoil a run. Exits 1 when a record is invalid."""
    params = _params(params_path)
    try:
        result = examine(Path(path), section(params, "model"), section(params, "data"),
                         section(params, "train").max_tokens, Path(base) if base else None)
    except (ValueError, FileNotFoundError) as error:
        raise click.ClickException(str(error)) from None
    if report:
        write_json(Path(report), result)
    click.echo(describe(result))
    if result["problem_count"]:
        raise SystemExit(1)


@main.command()
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, type=int, help="Port to listen on (0: any free one).")
@click.option("--workers", default=None, type=click.IntRange(min=1),
              help="Front-end processes (HTTP, validation, images, tokenising); default: half the CPUs, 1 to 8.")
@click.option("--gpus", default=None, metavar="LIST",
              help="GPUs to run an engine process on each, e.g. 0,1 (default: every GPU; without CUDA, one engine "
                   "on the CPU).")
@click.option("--api-key-env", default=None, metavar="VAR",
              help="Name of an environment variable holding the API key clients must send (Authorization: Bearer); "
                   "without it, any or no key is accepted.")
@click.option("--model-name", default=None, help="The served model's name (default: the checkpoint folder's name); "
                                                 "requests may also ask for jev-latest.")
@click.option("--max-queue-seconds", default=1.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Refuse new requests (429) while an engine's oldest waiting request has waited this long: "
                   "past the device's rate the excess is refused at once instead of queueing.")
@click.option("--drain-seconds", default=30.0, show_default=True, type=click.FloatRange(min=0),
              help="On SIGTERM or SIGINT, how long the front ends keep answering the requests they hold "
                   "(new connections are no longer taken); what is left after it is answered 503.")
def serve(checkpoint, host, port, workers, gpus, api_key_env, model_name, max_queue_seconds, drain_seconds):
    """Serve a calibrated CHECKPOINT (runs/calibrate/checkpoint) over TypeSafe Jev's /v1/systemone:
    front-end processes and one engine process a device, restarted if they die."""
    import logging
    import os

    from .runtime.checkpoint import load_front
    from .serve.supervisor import ServeSettings, Supervisor

    api_key = None
    if api_key_env is not None:
        api_key = os.environ.get(api_key_env)
        if not api_key:
            raise click.ClickException(f"--api-key-env {api_key_env}: that environment variable is empty or unset")
    folder = Path(checkpoint).resolve()
    try:  # a bad folder is refused here, before any process starts (the weights are hashed by the engines)
        template, _, _ = load_front(folder)
    except (ValueError, FileNotFoundError) as error:
        raise click.ClickException(str(error)) from None
    if template.pixels is None:
        raise click.ClickException(f"{folder}: its image processor is not a Qwen2-VL one the engines preprocess "
                                   f"on their device; it cannot be served split into front ends and engines")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = ServeSettings(str(folder), model_name or folder.name, host, port,
                             workers or max(1, min(8, (os.cpu_count() or 2) // 2)), _devices(gpus), api_key,
                             _release_date(folder), max_wait=max_queue_seconds, drain=drain_seconds)
    try:
        supervisor = Supervisor(settings)
    except OSError as error:  # the port is taken, or the address is not this machine's
        raise click.ClickException(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    supervisor.run()


def _devices(gpus: str | None) -> tuple[str, ...]:
    """The engines' devices: the listed GPUs, every GPU, or the CPU."""
    import torch

    if gpus is not None:
        try:
            indices = [int(part) for part in gpus.split(",") if part.strip()]
        except ValueError:
            raise click.ClickException(f"--gpus {gpus!r}: a comma-separated list of GPU indices, e.g. 0,1") from None
        count = torch.cuda.device_count()
        wrong = [index for index in indices if not 0 <= index < count]
        if not indices or wrong:
            raise click.ClickException(f"--gpus {gpus!r}: this machine has {count} GPUs (0 to {count - 1})")
        return tuple(f"cuda:{index}" for index in indices)
    if torch.cuda.is_available():
        return tuple(f"cuda:{index}" for index in range(torch.cuda.device_count()))
    return ("cpu",)


@main.command()
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False))
@click.option("--input", "source", required=True, type=click.Path(exists=True, dir_okay=False),
              help="Requests, one JSON object a line: the record format without labels, or /v1/systemone "
                   "bodies (base64 assets).")
@click.option("--output", required=True, type=click.Path(dir_okay=False),
              help="Answers, one line per input line in order; a rerun skips lines already answered.")
@click.option("--device", default=None, help="torch device (default: CUDA when present, else the CPU).")
def predict(checkpoint, source, output, device):
    """Answer every request of --input with a calibrated CHECKPOINT into --output."""
    from .serve.batch_predict import predict_file

    try:
        counts = predict_file(_load(Path(checkpoint), device), Path(source), Path(output))
    except ValueError as error:  # the output is not this input's answers, or the input is not UTF-8
        raise click.ClickException(str(error)) from None
    except OSError as error:  # the output's folder cannot be made or written
        raise click.ClickException(f"{error.filename or output}: {error.strerror or error}") from None
    click.echo(f"{counts['answered']} answered, {counts['errors']} invalid, {counts['skipped']} already answered "
               f"of {counts['lines']} lines -> {output}")


@main.group()
def public():
    """The upstream public mixture (data.source: public): its sources, fetching them, the guard."""


def _params(params_path: str) -> dict:
    """The params file's mapping ({} when it does not exist); a bad one is a one-line error."""
    try:
        return read_params(params_path) if Path(params_path).is_file() else {}
    except ValueError as error:  # ConfigError: not YAML, not UTF-8, not a mapping
        raise click.ClickException(str(error)) from None


def _public_sources(params_path: str, groups: tuple[str, ...]):
    from .data.public.mixture import select

    try:
        data = section(_params(params_path), "data")
        return data, select(groups or data.groups or None)
    except ValueError as error:
        raise click.ClickException(str(error)) from None


@public.command("sources")
@click.option("--params", "params_path", default="params.yaml", show_default=True,
              help="Parameters file for data.cache and data.groups (the defaults when it does not exist).")
@click.option("--group", "groups", multiple=True, help="Only the sources of this group (repeatable).")
def public_sources(params_path, groups):
    """List every source: its groups, origin, revision, license, and whether its raw files are cached."""
    from .data.public.sources import locate

    data, sources = _public_sources(params_path, groups)
    for name, source in sources.items():
        found, missing = locate(source, data.cache)
        origin = f"{source.hub}@{source.revision}" if source.hub else "its own release"
        state = "cached" if not missing else f"{len(missing)} of {len(source.files)} files missing"
        click.echo(f"{name:16s} {', '.join(source.groups)}\n    {origin}; {source.license}; {state}")


@public.command("fetch")
@click.option("--params", "params_path", default="params.yaml", show_default=True,
              help="Parameters file for data.cache and data.groups (the defaults when it does not exist).")
@click.option("--group", "groups", multiple=True, help="Only the sources of this group (repeatable).")
def public_fetch(params_path, groups):
    """Download the raw files of the selected sources into the cache (needs network), verify the
    pinned SHA-256s, and print the digest of every file (to pin the unpinned ones)."""
    from .data.public.sources import SourceIntegrityError, fetch

    data, sources = _public_sources(params_path, groups)
    try:
        digests = fetch(sources, data.cache, echo=click.echo)
    except (OSError, SourceIntegrityError) as error:
        raise click.ClickException(f"{type(error).__name__}: {error}") from None
    click.echo(json.dumps(digests, indent=2, sort_keys=True))


@public.command("fingerprint")
@click.argument("texts", type=click.File("r", encoding="utf-8"))
def public_fingerprint(texts):
    """Print the guard fingerprint of every line of TEXTS (- for standard input): put them in the
    file data.guard names to keep those texts out of every partition."""
    from .data.guard import fingerprint

    try:
        lines = list(texts)
    except UnicodeDecodeError as error:
        raise click.ClickException(f"{texts.name} is not UTF-8 text: {error}") from None
    for line in lines:
        digest = fingerprint(line.rstrip("\n"))
        if digest is not None:
            click.echo(digest)


def _load(folder: Path, device):
    import torch

    from .runtime.predict import Predictor

    if device is not None:
        try:
            chosen = torch.device(device)
        except RuntimeError:
            raise click.ClickException(f"--device {device!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
        if chosen.type == "cuda" and not torch.cuda.is_available():
            raise click.ClickException(f"--device {device}: this machine has no CUDA device")
    try:
        return Predictor.from_checkpoint(folder, device)
    except (ValueError, FileNotFoundError) as error:
        raise click.ClickException(str(error)) from None


def _release_date(folder: Path) -> str:
    """The date the checkpoint's manifest was written (YYYY-MM-DD)."""
    import datetime

    stamp = (folder / "manifest.json").stat().st_mtime if (folder / "manifest.json").is_file() else None
    day = datetime.date.fromtimestamp(stamp) if stamp is not None else datetime.date.today()
    return day.isoformat()


if __name__ == "__main__":
    main()
