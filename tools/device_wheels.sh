#!/usr/bin/env bash
# Wheels for the packages the GPU machine's image lacks (CPython 3.12, x86_64; no package index reachable there),
# downloaded here into .whl/ (git-ignored) for tools/gpu_check.sh to install from a carried .whl/ into /tmp/site.
# The image has torch, triton, numpy, transformers, jinja2, tqdm, rich, uvloop, multidict, aiofiles, httpx and
# prometheus-client; the server needs the rest (sanic and its parts, pydantic, msgspec, pyzmq, llguidance) and the
# GGUF tools need gguf. Kept under ~9 MB so that .whl and .peers (53 MB) fit one call's 64 MiB carry.
#
#   bash tools/device_wheels.sh         then carry [".whl", ".peers"] (or [".whl", ".smol/smol.part00"] ...)
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-.venv/bin/pip}
WANT=(gguf llguidance pydantic pydantic-core typing-inspection annotated-types msgspec pyzmq sanic sanic-routing
      tracerite html5tagger websockets httptools ujson)
mkdir -p .whl
$PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_31_x86_64 -d .whl "${WANT[@]}"
du -sh .whl
