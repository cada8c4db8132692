# Sourced by the device scripts (.ci/gpu, benchmarks/gpu.sh) from the repository root: install the
# carried wheels (.whl/, git-ignored) and make `import pipeserve` find a tree without pip (the
# device has no registry). The tree is this checkout, or TREE=<folder>: another checkout of
# pipeserve (an older commit in a git-ignored folder, say), so that the same commands measure
# both in one run.
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0   # the arch list: DeepSpeed's op builder cannot parse '9.0a'
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # NVLink multicast off
if [ ! -f /tmp/site/.installed ] || [ -n "$(find .whl -newer /tmp/site/.installed -name '*.whl' 2>/dev/null)" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 \
    && touch /tmp/site/.installed || echo "wheel install failed"
fi
PIPESERVE_TREE=$(cd "${TREE:-.}" && pwd) || { echo "TREE=$TREE: no such folder"; return 2; }
[ -f "$PIPESERVE_TREE/__init__.py" ] || { echo "$PIPESERVE_TREE is not a pipeserve checkout"; return 2; }
mkdir -p /tmp/pkg && ln -sfn "$PIPESERVE_TREE" /tmp/pkg/pipeserve
export PYTHONPATH=/tmp/pkg:/tmp/site PIPESERVE_TREE
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | sort | uniq -c
