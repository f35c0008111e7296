"""Calibration microbenchmarks for issue 12 (shapes unlike the accuracy set's), on a CUDA GPU.

    python bench/gpu_generality_calibrate.py OUT_DIR [conv|optim|compile ...]     (~3 minutes on an H100)

Writes OUT_DIR/gpu_generality_calibrate.jsonl, one line per measurement:

- ``conv``: cuDNN convolution workspaces. For each convolution shape (1x1, 3x3, strided,
  depthwise 7x7, stem 7x7/2; fp32, bf16, fp16), the transient bytes a forward and a backward
  take through the caching allocator beyond their inputs and outputs: max_memory_allocated during
  the op minus what is live after it. ``bench/conv_workspace_fit.py`` turns these into
  memlens/estimator/conv_workspaces.json (the one place the simulation reads them from).
- ``optim``: fused AdamW's device-side step counters and the absence of temporaries, foreach
  AdamW's temporary per parameter group, and clip_grad_norm_'s foreach_norm scratch, on a set of
  parameter tensors (checks memlens.step.optim's model of torch/optim/adam.py).
- ``compile``: torch.compile'd steps of two models at sizes outside the accuracy set
  (max_memory_allocated over 3 steps), for the gap between the compiled step and memlens'
  model of it (bench/generality_accuracy.py reads them when they are in the same OUT_DIR).
Each group runs in its own subprocess (bench/gpu_runner.py: a group that crashes loses only itself; a group already
run, in OUT_DIR/gpu_generality_calibrate_runs.jsonl, is skipped: --fresh runs them all again).
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_runner import list_or_run, runner_args  # noqa: E402

JSONL = "gpu_generality_calibrate.jsonl"

# (N, C_in, C_out, H, kernel, stride, groups): none of the accuracy set's layer shapes at its batch sizes
CONV_SHAPES = [
    (48, 64, 64, 56, 1, 1, 1), (48, 64, 64, 56, 3, 1, 1), (48, 128, 256, 28, 1, 1, 1), (48, 128, 128, 28, 3, 1, 1),
    (48, 256, 256, 14, 3, 1, 1), (48, 256, 512, 14, 3, 2, 1), (48, 512, 512, 7, 3, 1, 1), (48, 3, 64, 192, 7, 2, 1),
    (48, 96, 96, 56, 7, 1, 96), (48, 192, 192, 28, 7, 1, 192), (48, 384, 384, 14, 7, 1, 384), (24, 3, 96, 192, 4, 4, 1),
    (96, 64, 128, 32, 3, 1, 1), (96, 32, 32, 64, 3, 1, 32),
]


def _sync():
    import torch

    torch.cuda.synchronize()


def conv_group(out: str) -> None:
    import torch
    import torch.nn.functional as F

    dev = torch.device("cuda")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for (n, cin, cout, h, k, s, g) in CONV_SHAPES:
            x = torch.randn(n, cin, h, h, device=dev, dtype=dtype, requires_grad=True)
            w = torch.randn(cout, cin // g, k, k, device=dev, dtype=dtype, requires_grad=True)
            rec = {"group": "conv", "dtype": str(dtype).replace("torch.", ""), "shape": [n, cin, cout, h, k, s, g]}
            for rep in range(2):  # the first call may include one-off library set-up
                x.grad = w.grad = None
                _sync()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                y = F.conv2d(x, w, stride=s, padding=k // 2 if s == 1 else (k - s + 1) // 2, groups=g)
                _sync()
                fwd = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
                gy = torch.ones_like(y)
                _sync()
                torch.cuda.reset_peak_memory_stats()
                y.backward(gy)
                _sync()
                bwd = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
                rec[f"run{rep}"] = {"forward_transient": fwd, "backward_transient": bwd, "before": before,
                                    "input_bytes": x.numel() * x.element_size(), "output_bytes": y.numel() * y.element_size(),
                                    "weight_bytes": w.numel() * w.element_size()}
                del y, gy
            _emit(out, rec)
            del x, w
            torch.cuda.empty_cache()


def optim_group(out: str) -> None:
    import torch

    dev = torch.device("cuda")
    sizes = [3000 * 1000, 1000 * 777, 4096, 513, 2 * 1024 * 1024]
    for name, kw in (("adamw-fused", {"fused": True}), ("adamw-foreach", {"foreach": True})):
        params = [torch.nn.Parameter(torch.randn(n, device=dev)) for n in sizes]
        groups = [{"params": params[:3]}, {"params": params[3:]}]
        opt = torch.optim.AdamW(groups, lr=1e-3, **kw)
        for p in params:
            p.grad = torch.randn_like(p)
        _sync()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        opt.step()
        _sync()
        after = torch.cuda.memory_allocated()
        rec = {"group": "optim", "optimizer": name, "sizes": sizes, "param_bytes": sum(4 * n for n in sizes),
               "state_bytes_after_first_step": after - base, "step_transient": torch.cuda.max_memory_allocated() - after}
        torch.cuda.reset_peak_memory_stats()
        opt.step()
        _sync()
        rec["second_step_transient"] = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
        _emit(out, rec)
        del opt, params, groups
    params = [torch.nn.Parameter(torch.randn(n, device=dev)) for n in sizes]
    for p in params:
        p.grad = torch.randn_like(p)
    _sync()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    _sync()
    _emit(out, {"group": "optim", "optimizer": "clip_grad_norm_", "sizes": sizes, "transient": torch.cuda.max_memory_allocated() - base,
                "left": torch.cuda.memory_allocated() - base})


COMPILE_CASES = [
    ("calib-gpt2m-ampbf16-compile-b4-L512", dict(model="gpt2-medium", batch_size=4, seq_len=512, precision="amp-bf16", compile=True)),
    ("calib-qwen0.5b-bf16-compile-b2-L1024", dict(model="qwen2.5-0.5b", batch_size=2, seq_len=1024, precision="bf16", compile=True)),
    ("calib-qwen0.5b-bf16-eager-b2-L1024", dict(model="qwen2.5-0.5b", batch_size=2, seq_len=1024, precision="bf16")),
]


def compile_case(out: str, name: str) -> None:
    from bench.gpu_truth import run_case

    fields = dict(COMPILE_CASES)[name]
    rec = run_case(name, fields)
    rec["group"] = "compile"
    _emit(out, rec)


def _emit(out: str, rec: dict) -> None:
    with open(os.path.join(out, JSONL), "a") as f:
        f.write(json.dumps(rec) + "\n")


def group(name: str, out: str, dry: bool) -> dict:
    """One group (conv, optim) or compile case in its own subprocess (bench/gpu_runner.py). The measurements go to
    gpu_generality_calibrate.jsonl as before (conv_workspace_fit.py reads them); the run's line, to ..._runs.jsonl."""
    if dry:
        return {"dry_run": "GPU microbenchmarks: nothing to estimate"}
    before = _count(out)
    if name == "conv":
        conv_group(out)
    elif name == "optim":
        optim_group(out)
    else:
        compile_case(out, name)
    return {"lines": _count(out) - before}


def _count(out: str) -> int:
    p = os.path.join(out, JSONL)
    return sum(1 for _ in open(p)) if os.path.exists(p) else 0


def summary(out: str) -> None:
    for line in open(os.path.join(out, JSONL)):
        rec = json.loads(line)
        if rec.get("group") == "conv":
            r1 = rec["run1"]
            print(f"conv {rec['dtype']:9s} {str(rec['shape']):32s} fwd {r1['forward_transient'] / 2**20:8.2f} MiB "
                  f"bwd {r1['backward_transient'] / 2**20:8.2f} MiB")
        elif rec.get("group") == "optim":
            print("optim", {k: v for k, v in rec.items() if k not in ("group", "sizes")})
        else:
            print(rec.get("name"), rec.get("max_allocated"), rec.get("error", ""))


def main(argv: list[str] | None = None) -> None:
    a = runner_args(__doc__.splitlines()[0], out_positional=True, timeout=400).parse_args(argv)
    wanted = a.filters or ["conv", "optim", "compile"]
    a.filters = None
    jobs = [w for w in ("conv", "optim") if w in wanted] + ([n for n, _ in COMPILE_CASES] if "compile" in wanted else [])
    out = os.path.abspath(a.out)
    list_or_run(a, [(j, out) for j in jobs], fn=group, jsonl="gpu_generality_calibrate_runs.jsonl",
                env_file="gpu_generality_calibrate_env.json", columns=[("lines", lambda r: r.get("lines", "-"))])
    if not a.dry_run and not a.list and os.path.exists(os.path.join(out, JSONL)):
        summary(out)


if __name__ == "__main__":
    main()
