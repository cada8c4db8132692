"""`roofline --profile`'s kernel-time breakdown: kernel names of a real H100/H200 profile fall in
the right categories, and on CPU (operators instead of kernels, tiny model) a prefill and a
decode step are profiled, grouped and printed."""

from __future__ import annotations

import pytest
import torch

from pipeserve.kernels import kernel_ops
from pipeserve.launch.profile import Profiler
from tools.roofline import CATEGORY_ORDER, group_kernel_times, kernel_category, profile_cases
from pipeserve.runtime.bench import metrics as M
from pipeserve.runtime.worker.kv_cache import allocate_kv_cache
from pipeserve.runtime.model.loader import load_model
from pipeserve.runtime.worker.model_runner import ModelRunner

pytestmark = pytest.mark.timeout(120)

# Kernel names as torch.profiler reports them on Hopper (cuBLAS, cuBLASLt, cutlass, flash
# attention, Triton, PyTorch's own), with the category each belongs to.
NAMED = [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off"
     "_kernel__5x_cublas", "GEMM"),
    ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_TNT", "GEMM"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>(Params)", "GEMM"),
    ("_matmul_kernel", "GEMM"),
    ("void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t>>(Params)",
     "attention"),
    ("_paged_attention_kernel", "attention"),
    ("_add_rms_norm_kernel", "norm"),
    ("_rope_kernel", "rope"),
    ("_silu_mul_kernel", "silu·mul"),
    ("_write_kv_kernel", "KV write"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "collective"),
    ("void c10d::symmetric_memory::two_shot_all_reduce_kernel<c10::BFloat16, 16, 2>(...)", "collective"),
    ("_push_sum_kernel", "collective"),
    ("_push_add_rms_norm_kernel", "collective"),  # the sum with the next norm: counted as the sum
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>(int, ...)", "other"),
    ("Memcpy HtoD (Pinned -> Device)", "other"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<c10::BFloat16, at::native::ArgMaxOps>>", "other"),
]


def test_kernels_are_grouped_by_name():
    assert [kernel_category(name) for name, _ in NAMED] == [cat for _, cat in NAMED]
    seconds = {"GEMM": 4.0, "attention": 2.0, "norm": 0.5, "rope": 0.25, "silu·mul": 0.25, "KV write": 0.125,
               "collective": 1.0, "other": 3.0}
    per_category = {cat: sum(1 for _, c in NAMED if c == cat) for cat in CATEGORY_ORDER}
    kernels = [(name, seconds[cat] / per_category[cat]) for name, cat in NAMED]
    grouped = group_kernel_times(kernels)
    assert list(grouped) == list(CATEGORY_ORDER)
    assert grouped == pytest.approx(seconds)
    assert group_kernel_times([]) == dict.fromkeys(CATEGORY_ORDER, 0.0)


def test_profile_breakdown_on_cpu(tiny_model, capsys):
    device = torch.device("cpu")
    loaded = load_model(tiny_model, dtype=torch.float32, device=device)
    loaded.model.set_ops(kernel_ops("torch", device))
    cfg = loaded.config
    kv = allocate_kv_cache(cfg, num_layers=cfg.num_hidden_layers, num_blocks=32, block_size=16, dtype=torch.float32,
                           device=device)
    runner = ModelRunner(loaded.model, kv_caches=kv, block_size=16, device=device)
    profiler = Profiler(runner, block_size=16, vocab_size=cfg.vocab_size, device=device)
    cases = {"prefill 64 (prefix 0)": [(0, 64)], "decode 4 × ctx 32": [(31, 1)] * 4}
    rows = {name: {"seconds": profiler.time(seqs, 2)} for name, seqs in cases.items()}
    profile_cases(profiler, cases, rows, M.ModelShape.of(cfg, 4))
    for name, row in rows.items():
        prof = row["profile"]
        assert list(prof["categories_s"]) == list(CATEGORY_ORDER)
        assert prof["kernel_s"] == pytest.approx(sum(prof["categories_s"].values()))
        assert prof["categories_s"]["GEMM"] > 0  # aten::mm / addmm of the linear layers
        assert 0 < prof["kernel_s"] < 10 * prof["timed_s"]  # per step (three profiled runs averaged)
        assert prof["top_kernels"] and all(cat in CATEGORY_ORDER for _, _, cat in prof["top_kernels"])
    assert rows["prefill 64 (prefix 0)"]["profile"]["gemm_tflops"] > 0
    decode = rows["decode 4 × ctx 32"]["profile"]
    assert decode["gemm_GBps"] > 0 and "gemm_tflops" not in decode
    out = capsys.readouterr().out
    assert out.count("| kernels | ms | share of kernel time |") == 2 and "| GEMM |" in out and "gap" in out
