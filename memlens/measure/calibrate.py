"""`memlens calibrate`: measure the timing table of the GPU this runs on (memlens.estimator.timing.tables).

What it measures, each with CUDA events after a warm-up (small kernels replayed from a CUDA graph, so the GPU's
own time is read, not the host's launch rate):

- matmuls: TFLOP/s over the table's (M, N, K) grid for bf16, fp16, fp32 and tf32;
- fused attention (SDPA, the kernel PyTorch picks for bf16/fp16, not causal): forward and backward TFLOP/s by
  sequence length (head dim 128);
- memory traffic: a copy's bytes read + written per second, by size;
- the kernel floor (a tiny kernel back to back) and the host's dispatch cost per op: an eager Python op, an op the
  autograd engine runs in backward, a foreach op, a view;
- pinned host <-> GPU copies (PCIe);
- NCCL all-reduce and all-gather bus bandwidth by size over every visible GPU (when there are several).

>>> quick_grid(True)[0][:3]
(256, 1024, 4096)
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable

from ..core.errors import MemlensError
from ..core.gpus import GPUS
from ..estimator.timing.tables import (
    FORMAT, GRID_BYTES, GRID_M, GRID_NCCL, GRID_NK, GRID_SEQ, TimingTable, _add_logs,
)

_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32", "tf32": "float32"}


def quick_grid(quick: bool) -> tuple[tuple, tuple, tuple, tuple]:
    """(M, N/K, bytes, seq) grids: the table's, or a small one (``--quick``, a smoke test)."""
    if quick:
        return (256, 1024, 4096), (256, 1024, 4096), (2**16, 2**22, 2**26), (512, 2048)
    return GRID_M, GRID_NK, GRID_BYTES, GRID_SEQ


def gpu_name_of(device_name: str) -> str:
    """The registry name of a CUDA device (``"NVIDIA H100 80GB HBM3"`` -> ``"h100"``), or its own name lowercased."""
    low = device_name.lower()
    for name, f in GPUS.items():
        if f.label.lower() == low:
            return name
    for name in sorted(GPUS, key=len, reverse=True):
        if name.split("-")[0] in low.replace(" ", "-").replace("geforce-", ""):
            return name
    return low.replace("nvidia ", "").replace(" ", "-")


def _gpu_seconds(torch, fn: Callable[[], Any], budget_s: float = 0.02, max_reps: int = 20) -> float:
    """Median-free mean GPU seconds of ``fn`` (CUDA events), after one warm-up; repeats until ``budget_s``."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    one = start.elapsed_time(end) / 1e3
    reps = max(1, min(max_reps, int(budget_s / max(one, 1e-6))))
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def _graphed_seconds(torch, fn: Callable[[], Any], n: int = 20) -> float:
    """GPU seconds per call of a small ``fn`` replayed ``n`` times from a CUDA graph (no host launch gaps)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    return _gpu_seconds(torch, g.replay, budget_s=0.01) / n


def measure_matmul(torch, dev, ms, nks, log) -> dict:
    out = {}
    for key, dt in _DTYPES.items():
        torch.backends.cuda.matmul.allow_tf32 = key == "tf32"
        dtype = getattr(torch, dt)
        grid = []
        for m in ms:
            plane = []
            for n in nks:
                row = []
                for k in nks:
                    a = torch.randn(m, k, device=dev, dtype=dtype)
                    b = torch.randn(k, n, device=dev, dtype=dtype)
                    fn = (lambda a=a, b=b: a @ b)
                    sec = _graphed_seconds(torch, fn, 5) if 2 * m * n * k < 2e9 else _gpu_seconds(torch, fn)
                    row.append(round(2 * m * n * k / sec / 1e12, 3))
                    del a, b
                plane.append(row)
            grid.append(plane)
        out[key] = {"m": list(ms), "n": list(nks), "k": list(nks), "tflops": grid}
        log(f"matmul {key}: {max(max(max(r) for r in p) for p in grid):.0f} TFLOP/s at best")
    torch.backends.cuda.matmul.allow_tf32 = False
    return out


def measure_attention(torch, dev, seqs, log) -> dict:
    import torch.nn.functional as F  # heavy: torch

    out = {}
    for key in ("bfloat16", "float16"):
        dtype = getattr(torch, key)
        fwd, bwd = [], []
        for L in seqs:
            B, H, D = max(1, 32768 // L), 16, 128
            q, k, v = (torch.randn(B, H, L, D, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
            fl = 4 * B * H * L * L * D
            tf = _gpu_seconds(torch, lambda: F.scaled_dot_product_attention(q, k, v))
            o = F.scaled_dot_product_attention(q, k, v)
            g = torch.randn_like(o)

            def back():
                out_ = F.scaled_dot_product_attention(q, k, v)
                torch.autograd.grad(out_, (q, k, v), g)

            tb = max(1e-9, _gpu_seconds(torch, back) - tf)
            fwd.append(round(fl / tf / 1e12, 3))
            bwd.append(round(2.5 * fl / tb / 1e12, 3))
            del q, k, v, o, g
        out[key] = {"seq": list(seqs), "fwd_tflops": fwd, "bwd_tflops": bwd}
        log(f"attention {key}: fwd {max(fwd):.0f}, bwd {max(bwd):.0f} TFLOP/s at best")
    return out


def measure_bandwidth(torch, dev, sizes, log) -> dict:
    gbps = []
    for nbytes in sizes:
        src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        fn = (lambda: dst.copy_(src))
        sec = _graphed_seconds(torch, fn) if nbytes <= 2**24 else _gpu_seconds(torch, fn)
        gbps.append(round(2 * nbytes / sec / 1e9, 2))
        del src, dst
    log(f"copy bandwidth: {max(gbps):.0f} GB/s at best")
    return {"bytes": list(sizes), "gbps": gbps}


def measure_host(torch, dev, log) -> tuple[float, dict]:
    """The kernel floor (µs of GPU per tiny kernel, graphed) and the host's dispatch µs per op of each kind."""
    x = torch.ones(8, device=dev)
    floor = _graphed_seconds(torch, lambda: x.add_(1), n=100) * 1e6

    def host_us(fn, n: int = 2000) -> float:
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        dt = time.perf_counter() - t
        torch.cuda.synchronize()
        return dt / n * 1e6

    lin = torch.nn.Linear(8, 8, device=dev)
    forward = host_us(lambda: torch.nn.functional.gelu(lin(x)), 1000) / 3   # a module call: addmm, gelu, its hooks
    view = host_us(lambda: x.view(2, 4))
    # backward: a chain of 200 small ops (mul, add) on the autograd engine, its wall time per node (the GPU idles)
    w = torch.ones(8, device=dev, requires_grad=True)

    def chain():
        y = w
        for _ in range(100):
            y = y * 1.0001 + 0.0
        return y.sum()

    y = chain()
    torch.cuda.synchronize()
    t = time.perf_counter()
    y.backward()
    torch.cuda.synchronize()
    backward = (time.perf_counter() - t) / 201 * 1e6
    ts = [torch.ones(1024, device=dev) for _ in range(100)]
    optimizer = host_us(lambda: torch._foreach_add_(ts, 1.0), 300)
    host = {"forward": round(forward, 2), "backward": round(backward, 2), "optimizer": round(optimizer, 2), "view": round(view, 2)}
    log(f"kernel floor {floor:.2f} us; host per op {host}")
    return round(floor, 3), host


def measure_pcie(torch, dev, log) -> dict:
    n = 256 * 2**20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    d = torch.empty(n, dtype=torch.uint8, device=dev)
    h2d = n / _gpu_seconds(torch, lambda: d.copy_(host, non_blocking=True), budget_s=0.1) / 1e9
    d2h = n / _gpu_seconds(torch, lambda: host.copy_(d, non_blocking=True), budget_s=0.1) / 1e9
    log(f"PCIe h2d {h2d:.1f} GB/s, d2h {d2h:.1f} GB/s")
    return {"h2d": round(h2d, 2), "d2h": round(d2h, 2)}


def _nccl_worker(rank: int, world: int, sizes: tuple, path: str) -> None:
    import json

    import torch  # heavy: torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{path}.store", rank=rank, world_size=world)
    res: dict = {"all_reduce": [], "all_gather": []}
    for nbytes in sizes:
        buf = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
        shard = buf[: buf.numel() // world]
        for op, fn, factor in (("all_reduce", lambda: dist.all_reduce(buf), 2 * (world - 1) / world),
                               ("all_gather", lambda: dist.all_gather_into_tensor(out, shard), (world - 1) / world)):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            t = time.perf_counter()
            reps = 10
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
            sec = (time.perf_counter() - t) / reps
            res[op].append(round(nbytes * factor / sec / 1e9, 2))
    if rank == 0:
        with open(path, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


def measure_nccl(torch, world: int, sizes, log) -> dict:
    import tempfile

    import torch.multiprocessing as mp  # heavy: torch

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "nccl.json")
        mp.spawn(_nccl_worker, args=(world, tuple(sizes), path), nprocs=world, join=True)
        import json

        res = json.load(open(path))
    out = {str(world): {op: {"bytes": list(sizes), "busbw_gbps": v, "latency_us": 15.0} for op, v in res.items()}}
    log(f"NCCL over {world} GPUs: all-reduce {max(res['all_reduce']):.0f} GB/s bus bandwidth at best")
    return out


def calibrate(device: str = "cuda", quick: bool = False, nccl: bool = True, log: Callable[[str], None] = print) -> TimingTable:
    """Measure the timing table of ``device`` (a CUDA GPU). ``quick``: small grids (a smoke test, not a table to ship).

    >>> calibrate("cpu")                                          # doctest: +SKIP
    Traceback (most recent call last):
    MemlensError: calibrate measures a CUDA GPU
    """
    import torch  # heavy: torch

    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        raise MemlensError("calibrate measures a CUDA GPU and none is available here",
                           hint="run `memlens calibrate` on the GPU machine; without a table memlens uses data-sheet rates")
    dev = torch.device(device)
    t0 = time.perf_counter()
    label = torch.cuda.get_device_name(dev)
    ms, nks, sizes, seqs = quick_grid(quick)
    log(f"calibrating {label} (torch {torch.__version__}, CUDA {torch.version.cuda})")
    t = TimingTable(gpu=gpu_name_of(label), device_name=label, calibrated=not quick,
                    source="memlens calibrate" + (" --quick (small grids: not for shipping)" if quick else ""),
                    env={"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": torch.cuda.device_count(),
                         "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, format=FORMAT)
    t.matmul = measure_matmul(torch, dev, ms, nks, log)
    t.attention = measure_attention(torch, dev, seqs, log)
    t.bandwidth = measure_bandwidth(torch, dev, sizes, log)
    t.min_kernel_us, t.host_us = measure_host(torch, dev, log)
    t.pcie_gbps = measure_pcie(torch, dev, log)
    world = torch.cuda.device_count()
    if nccl and world > 1:
        t.nccl = measure_nccl(torch, world, GRID_NCCL if not quick else GRID_NCCL[::3], log)
    else:
        from ..estimator.timing.tables import _datasheet_nccl

        t.nccl = {str(w): _datasheet_nccl(t.gpu, w) for w in (2, 4, 8)} if t.gpu in GPUS else {}
        t.env["nccl"] = "data sheet (one GPU here)"
    t.env["seconds"] = round(time.perf_counter() - t0, 1)
    _add_logs(t)
    log(f"calibrated in {t.env['seconds']} s")
    return t
