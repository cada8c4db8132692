# Sourced by the device scripts: install the carried wheels (.whl/, git-ignored) and make
# `import pipeserve` find this tree without pip (the device has no registry).
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ ! -f /tmp/site/.installed ] || [ -n "$(find .whl -newer /tmp/site/.installed -name '*.whl' 2>/dev/null)" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 \
    && touch /tmp/site/.installed || echo "wheel install failed"
fi
mkdir -p /tmp/pkg && ln -sfn "$(pwd)" /tmp/pkg/pipeserve
export PYTHONPATH=/tmp/pkg:/tmp/site
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | sort | uniq -c
