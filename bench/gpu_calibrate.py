"""Measure the CUDA-side facts the estimator maps CPU behaviour onto (run on the GPU machine).

python bench/gpu_calibrate.py OUT_DIR  -> OUT_DIR/gpu_calibration.json
- CUDA context: what NVML shows for the process beyond PyTorch's reserved memory;
- cuBLAS / cuBLASLt workspaces: memory_allocated growth at the first matmuls, forward and backward;
- SDPA: the backend PyTorch picks per dtype / mask / dropout / GQA / head dim, and the memory its
  forward keeps and its backward needs;
- embedding backward and cross-entropy scratch.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

MiB = 1024 * 1024


def nvml_used() -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
            if p.pid == os.getpid():
                return p.usedGpuMemory
    except Exception:  # noqa: BLE001
        return None
    return None


def workspaces() -> dict:
    r = {}
    a0 = torch.cuda.memory_allocated()
    x = torch.randn(256, 256, device="cuda")
    r["alloc_after_input"] = torch.cuda.memory_allocated() - a0
    y = x @ x
    torch.cuda.synchronize()
    r["first_fp32_mm_delta"] = torch.cuda.memory_allocated() - a0 - 2 * 256 * 256 * 4
    xb = x.bfloat16()
    a1 = torch.cuda.memory_allocated()
    yb = xb @ xb
    torch.cuda.synchronize()
    r["first_bf16_mm_delta"] = torch.cuda.memory_allocated() - a1 - 256 * 256 * 2
    lin = torch.nn.Linear(256, 256, device="cuda")
    a2 = torch.cuda.memory_allocated()
    z = lin(x)
    torch.cuda.synchronize()
    r["first_addmm_bias_delta"] = torch.cuda.memory_allocated() - a2 - 256 * 256 * 4
    w = torch.randn(256, 256, device="cuda", requires_grad=True)
    a3 = torch.cuda.memory_allocated()
    (x @ w).sum().backward()
    torch.cuda.synchronize()
    r["first_backward_mm_delta"] = torch.cuda.memory_allocated() - a3 - 256 * 256 * 4  # w.grad
    r["allocated_total"] = torch.cuda.memory_allocated()
    r["reserved_total"] = torch.cuda.memory_reserved()
    r["nvml_process_used"] = nvml_used()
    del y, yb, z
    return r


def sdpa_case(B, H, Hk, L, D, dtype, mask, dropout, causal, gqa) -> dict:
    torch.cuda.empty_cache()
    dt = getattr(torch, dtype)
    q = torch.randn(B, L, H, D, device="cuda", dtype=dt).transpose(1, 2).requires_grad_()
    k = torch.randn(B, L, Hk, D, device="cuda", dtype=dt).transpose(1, 2).requires_grad_()
    v = torch.randn(B, L, Hk, D, device="cuda", dtype=dt).transpose(1, 2).requires_grad_()
    m = None
    if mask == "bool":
        m = torch.ones(B, 1, L, L, device="cuda", dtype=torch.bool).tril()
    elif mask == "float":
        m = torch.zeros(B, 1, L, L, device="cuda", dtype=dt)
    kw = {"enable_gqa": True} if gqa else {}
    try:
        choice = int(torch._fused_sdp_choice(q, k, v, m, dropout, causal, **kw))
    except Exception as e:  # noqa: BLE001
        choice = f"err {e}"
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=dropout, is_causal=causal, **kw)
    torch.cuda.synchronize()
    fwd_kept = torch.cuda.memory_allocated() - base
    fwd_peak = torch.cuda.max_memory_allocated() - base
    g = torch.randn_like(out)
    torch.cuda.synchronize()
    base2 = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out.backward(g)
    torch.cuda.synchronize()
    bwd_peak = torch.cuda.max_memory_allocated() - base2
    del out
    after = torch.cuda.memory_allocated() - base2
    names = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=dropout, is_causal=causal, **kw)
    names = sorted({e.name for e in prof.events() if "attention" in e.name or "flash" in e.name or "efficient" in e.name or "cudnn" in e.name})
    return {"B": B, "H": H, "Hk": Hk, "L": L, "D": D, "dtype": dtype, "mask": mask, "dropout": dropout, "causal": causal,
            "gqa": gqa, "choice": choice, "ops": names, "out_bytes": B * H * L * D * q.element_size(),
            "fwd_kept": fwd_kept, "fwd_peak": fwd_peak, "bwd_peak": bwd_peak, "bwd_after_minus_out": after,
            "q_bytes": q.numel() * q.element_size(), "k_bytes": k.numel() * k.element_size()}


def main() -> None:
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    res = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0)}
    res["nvml_before_cuda"] = None
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    res["context_only"] = {"nvml_process_used": nvml_used(), "reserved": torch.cuda.memory_reserved()}
    res["workspaces"] = workspaces()
    cases = []
    for dtype in ("bfloat16", "float16", "float32"):
        for (mask, causal) in ((None, True), ("bool", False), ("float", False)):
            for dropout in (0.0, 0.1):
                for (H, Hk, gqa, D) in ((12, 12, False, 64), (32, 8, True, 64), (16, 16, False, 128)):
                    try:
                        cases.append(sdpa_case(2, H, Hk, 1024, D, dtype, mask, dropout, causal, gqa))
                    except Exception as e:  # noqa: BLE001
                        cases.append({"dtype": dtype, "mask": mask, "dropout": dropout, "H": H, "gqa": gqa, "error": str(e)[:300]})
    res["sdpa"] = cases
    # embedding backward scratch
    emb = torch.nn.Embedding(50257, 768, device="cuda")
    ids = torch.randint(0, 50257, (8, 1024), device="cuda")
    o = emb(ids)
    torch.cuda.synchronize()
    b = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    o.backward(torch.ones_like(o))
    torch.cuda.synchronize()
    res["embedding_bwd"] = {"peak_over_base": torch.cuda.max_memory_allocated() - b, "grad_bytes": 50257 * 768 * 4,
                            "ones_bytes": o.numel() * 4}
    with open(os.path.join(out, "gpu_calibration.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "sdpa"}, indent=1))
    for c in cases:
        print({k: c.get(k) for k in ("dtype", "mask", "dropout", "H", "Hk", "D", "choice", "ops", "fwd_kept", "out_bytes", "bwd_peak")})


if __name__ == "__main__":
    main()
