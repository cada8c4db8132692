#!/usr/bin/env bash
# Download the wheels pipeserve needs on the GPU image and that image lacks (it has torch, triton,
# transformers, aiohttp, prometheus-client, jinja2, tokenizers, anyio, h11, click; no registry):
# the runtime's (Hydra, ZeroMQ, msgspec, gguf, xgrammar, the HTTP server's FastAPI stack) and the
# GPU tests' (pytest-timeout, jsonschema). Versions are those the CPU CI runs; pydantic's match
# fetch_fastgen_wheels.sh's, so both sets can share one folder.
# Usage: fetch_gpu_wheels.sh DIR   (DIR git-ignored, .whl by convention; carry it with the command)
set -euo pipefail
dir=${1:?usage: $0 DIR}
mkdir -p "$dir"
plat=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64 --platform any)
python3 -m pip download -q --no-deps --only-binary=:all: "${plat[@]}" -d "$dir" \
  hydra-core==1.3.8 omegaconf==2.3.1 pyzmq==27.3.0 msgspec==0.22.0 gguf==0.19.0 \
  xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 opentelemetry-api==1.45.2 \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection \
  pytest-timeout==2.4.0 jsonschema==4.26.0 jsonschema-specifications referencing rpds-py
# Hydra's parser runtime is published as source only: build its wheel here (pure python).
tmp=$(mktemp -d)
python3 -m pip wheel -q --no-deps -w "$tmp" antlr4-python3-runtime==4.9.3
cp "$tmp"/antlr4_python3_runtime-*.whl "$dir"/
rm -rf "$tmp"
# The GPT-2 tokenizer older trees' benchmarks need (benchmarks/README.md, "Carry").
shared=$(cd "$(dirname "$0")/../.." && pwd)/shared/data/gpt2_tokenizer.json
[ -f "$shared" ] && cp -f "$shared" "$dir"/ || echo "note: no $shared; older trees' benchmarks need a gpt2_tokenizer.json in $dir"
ls -la "$dir"
