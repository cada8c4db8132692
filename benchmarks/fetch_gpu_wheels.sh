#!/usr/bin/env bash
# Download, on a machine with a package registry, the wheels a GPU machine's image lacks (it has
# torch, triton, transformers, aiohttp, prometheus-client, jinja2, tokenizers, anyio, h11, click,
# grpcio, msgpack, ninja, psutil and py-cpuinfo; no registry) into DIR, git-ignored, which travels
# with the code (carry it):
#
#   fetch_gpu_wheels.sh DIR            pipeserve's: the runtime's (Hydra, ZeroMQ, msgspec, gguf,
#                                      xgrammar, the HTTP server's FastAPI stack) and the GPU tests'
#                                      (pytest-timeout, jsonschema); .whl by convention
#   fetch_gpu_wheels.sh --fastgen DIR  DeepSpeed-FastGen's (deepspeed, deepspeed-kernels,
#                                      deepspeed-mii and their missing dependencies, ~53 MB)
#
# Versions are those the CPU CI runs; pydantic's are the same in both sets, so they can share a
# folder (two versions of one package stop the install there).
set -euo pipefail
fastgen=""
[ "${1:-}" = --fastgen ] && { fastgen=1; shift; }
dir=${1:?usage: $0 [--fastgen] DIR}
mkdir -p "$dir"
plat=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
pydantic=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection)
wheel_from_source() {  # a pure-python package published as source only
  local tmp; tmp=$(mktemp -d)
  python3 -m pip wheel -q --no-deps -w "$tmp" "$1"
  cp "$tmp"/*.whl "$dir"/
  rm -rf "$tmp"
}
if [ -n "$fastgen" ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: "${plat[@]}" -d "$dir" \
    deepspeed-kernels deepspeed-mii==0.3.3 "${pydantic[@]}" \
    typing-extensions hjson ujson shortuuid pydantic-settings python-dotenv pyzmq
  wheel_from_source deepspeed==0.19.8
else
  python3 -m pip download -q --no-deps --only-binary=:all: "${plat[@]}" -d "$dir" \
    hydra-core==1.3.8 omegaconf==2.3.1 pyzmq==27.3.0 msgspec==0.22.0 gguf==0.19.0 \
    xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 \
    fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 opentelemetry-api==1.45.2 "${pydantic[@]}" \
    pytest-timeout==2.4.0 jsonschema==4.26.0 jsonschema-specifications referencing rpds-py
  wheel_from_source antlr4-python3-runtime==4.9.3   # Hydra's parser runtime
  # The GPT-2 tokenizer older trees' benchmarks need (benchmarks/README.md, "Carry").
  shared=$(cd "$(dirname "$0")/../.." && pwd)/shared/data/gpt2_tokenizer.json
  [ -f "$shared" ] && cp -f "$shared" "$dir"/ || echo "note: no $shared; older trees' benchmarks need a gpt2_tokenizer.json in $dir"
fi
ls -la "$dir"
