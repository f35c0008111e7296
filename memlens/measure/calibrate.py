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
- with several GPUs visible, over all of them (memlens.measure.calibrate_nccl): NCCL's bus bandwidth by size, what a
  collective beside compute costs the compute, FSDP2's hooks over real all-gathers.

>>> quick_grid(True)[0][:3]
(256, 1024, 4096)
"""
from __future__ import annotations

import itertools
import math
import statistics
import time
from typing import Any, Callable

from ..core.errors import MemlensError
from ..core.gpus import GPUS
from .calibrate_fsdp import measure_fsdp_host
from .calibrate_nccl import measure_ranks
from .host_phases import CALIB_LLAMA, host_rounds
from ..estimator.timing.tables import (
    FORMAT, GRID_BYTES, GRID_M, GRID_NCCL, GRID_NK, GRID_SEQ, MATMUL_TIMER, TimingTable, _add_logs,
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


# A GEMM under this many FLOPs (under ~0.3 ms on an H100 / H200) is timed from a CUDA graph: launched from a Python
# loop, a kernel shorter than the loop's own host time per call (``a @ b``: tens of us) is timed at the host's pace.
# The tables calibrated before (graphed only under 2e9) priced 4096 x 2048 x 512 at 279 TFLOP/s on an H200 where a
# step's profile ran it at 613, and 4096 x 2048 x 2048 at 604 against 727-782 (bench/results/bandwidth_probe.md).
GRAPH_FLOPS = 2e11


def matmul_timer() -> str:
    """What a table's env says of how its GEMM grids were timed (``env[MATMUL_TIMER]``; a calibrated table without it
    timed GEMMs over 2e9 FLOPs from a Python loop, and says so: memlens.estimator.timing.tables)."""
    return f"CUDA graph under {GRAPH_FLOPS:g} FLOPs"


def _gemm_seconds(torch, fn: Callable[[], Any], flops: float) -> float:
    return _graphed_seconds(torch, fn, 5) if flops < GRAPH_FLOPS else _gpu_seconds(torch, fn)


def _grid(ms, nks, rate: Callable[[int, int, int], float], ns=None) -> list:
    """[m][n][k] of ``rate(m, n, k)`` to 4 significant digits, over the (M, N, K) axes (N the K grid unless ``ns`` is
    given). Not to a fixed number of decimals: the grid's smallest GEMMs (16 x 8 x 8, 2,048 FLOPs in a few us) run
    under 0.001 TFLOP/s, which 3 decimals would write as 0 - a rate the log-space interpolation cannot use.

    >>> _grid((16,), (8, 4096), lambda m, n, k: 2 * m * n * k / 4e-6 / 1e12)
    [[[0.000512, 0.2621], [0.2621, 134.2]]]
    """
    return [[[float(f"{rate(m, n, k):.4g}") for k in nks] for n in (ns or nks)] for m in ms]


def _best(grid: list) -> float:
    return max(max(max(r) for r in p) for p in grid)


def measure_matmul(torch, dev, ms, nks, log) -> dict:
    out = {}
    for key, dt in _DTYPES.items():
        torch.backends.cuda.matmul.allow_tf32 = key == "tf32"
        dtype = getattr(torch, dt)

        def rate(m: int, n: int, k: int) -> float:
            a = torch.randn(m, k, device=dev, dtype=dtype)
            b = torch.randn(k, n, device=dev, dtype=dtype)
            fn = (lambda: a @ b)
            sec = _gemm_seconds(torch, fn, 2 * m * n * k)
            return 2 * m * n * k / sec / 1e12

        grid = _grid(ms, nks, rate)
        out[key] = {"m": list(ms), "n": list(nks), "k": list(nks), "tflops": grid}
        log(f"matmul {key}: {_best(grid):.0f} TFLOP/s at best")
    torch.backends.cuda.matmul.allow_tf32 = False
    return out


# name -> (head dim, causal, dropout p): "d" with dropout 0.1 on the probabilities (GPT-2's attn_pdrop in training)
ATTENTION_VARIANTS = {"128": (128, False, 0.0), "64": (64, False, 0.0), "64c": (64, True, 0.0), "128c": (128, True, 0.0),
                      "64cd": (64, True, 0.1), "128cd": (128, True, 0.1)}


def _attention_row(torch, dev, dtype, seqs, D: int, causal: bool, p: float = 0.0) -> tuple[list, list]:
    """Forward and backward TFLOP/s of SDPA (the kernel PyTorch picks) by sequence length, 32k tokens of 2048
    model width (H = 2048 / D heads); a causal mask's FLOPs are half (the kernels skip the masked tiles)."""
    import torch.nn.functional as F  # heavy: torch

    fwd, bwd = [], []
    for L in seqs:
        B, H = max(1, 32768 // L), 2048 // D
        q, k, v = (torch.randn(B, H, L, D, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
        fl = 4 * B * H * L * L * D // (2 if causal else 1)
        tf = _gpu_seconds(torch, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=p))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=p)
        g = torch.randn_like(o)

        def back():
            out_ = F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=p)
            torch.autograd.grad(out_, (q, k, v), g)

        tb = max(1e-9, _gpu_seconds(torch, back) - tf)
        fwd.append(round(fl / tf / 1e12, 3))
        bwd.append(round(2.5 * fl / tb / 1e12, 3))
        del q, k, v, o, g
    return fwd, bwd


UNALIGNED_M, UNALIGNED_NK = (1024, 16384), (1024, 4096, 16384)
# the output's N reaches a vocabulary's width: an LM head of 50,257 (GPT-2) or 151,655 words writes rows no grid point
# of 16,384 stands for (cuBLAS picks other kernels for a wide unaligned output: on an H200 the GPT-2 head's forward GEMM
# ran 6.6 ms where the 16,384 point gave 4.4)
UNALIGNED_OUT_N = (1024, 4096, 16384, 65536)


def measure_matmul_unaligned(torch, dev, log, ms=UNALIGNED_M, nks=UNALIGNED_NK, out_ns=UNALIGNED_OUT_N) -> tuple[dict, dict]:
    """16-bit GEMMs whose leading dimension is one element off 16 bytes, over a coarse grid: (an input's: the
    geometric mean of A's rows and A transposed - GPT-2's 50,257-word head in backward -, the output's rows: the
    head in forward, its N up to a vocabulary's width).

    The output's is measured as a Linear layer runs it: ``x @ W.t()`` with ``W`` (N x K) row-major (F.linear), so only
    the output's leading dimension is off. Measured with ``B`` (K x N) itself unaligned instead (this grid before), a
    wide output ran at full rate where the GPT-2 head's forward ran at ~95 TFLOP/s on an H100 (bench/results/
    step_time_h100.md): cuBLAS picks other kernels for the two layouts."""
    ins, outs = {}, {}
    for key in ("bfloat16", "float16"):
        dtype = getattr(torch, key)
        # (A's shape, B's shape, how the product is formed)
        layouts = {"out": (((lambda m, n, k: (m, k)), (lambda m, n, k: (n - 1, k)), "linear"),),
                   "in": (((lambda m, n, k: (m, k - 1)), (lambda m, n, k: (k - 1, n)), "nn"),
                          ((lambda m, n, k: (k, m - 1)), (lambda m, n, k: (k, n)), "tn"))}
        forms = {"nn": lambda a, b: a @ b, "tn": lambda a, b: a.t() @ b, "linear": lambda a, b: a @ b.t()}

        def rate(which: str, m: int, n: int, k: int) -> float:
            logs = 0.0
            for sa, sb, form in layouts[which]:
                a = torch.randn(*sa(m, n, k), device=dev, dtype=dtype)
                b = torch.randn(*sb(m, n, k), device=dev, dtype=dtype)
                fn = (lambda f=forms[form]: f(a, b))
                rows, inner = (a.shape[1], a.shape[0]) if form == "tn" else tuple(a.shape)
                cols = b.shape[0] if form == "linear" else b.shape[1]
                flops = 2 * rows * inner * cols
                logs += math.log(flops / _gemm_seconds(torch, fn, flops) / 1e12)
            return math.exp(logs / len(layouts[which]))

        for which, into, ns in (("in", ins, nks), ("out", outs, out_ns)):
            grid = _grid(ms, nks, lambda m, n, k, w=which: rate(w, m, n, k), ns=ns)
            into[key] = {"m": list(ms), "n": list(ns), "k": list(nks), "tflops": grid}
        log(f"matmul {key}, unaligned leading dims: {_best(ins[key]['tflops']):.0f} TFLOP/s at best (an input's), "
            f"{_best(outs[key]['tflops']):.0f} (the output's)")
    return ins, outs


def measure_attention(torch, dev, seqs, log) -> dict:
    """Per dtype: the head-dim-128 row without a mask (``fwd_tflops``, ``bwd_tflops``) and its ``variants``."""
    out = {}
    for key in ("bfloat16", "float16"):
        dtype = getattr(torch, key)
        rows = {name: _attention_row(torch, dev, dtype, seqs, D, causal, p) for name, (D, causal, p) in ATTENTION_VARIANTS.items()}
        fwd, bwd = rows.pop("128")
        out[key] = {"seq": list(seqs), "fwd_tflops": fwd, "bwd_tflops": bwd,
                    "variants": {name: {"fwd_tflops": f, "bwd_tflops": b} for name, (f, b) in rows.items()}}
        log(f"attention {key}: fwd {max(fwd):.0f}, bwd {max(bwd):.0f} TFLOP/s at best (head dim 128; 64: "
            f"{max(rows['64'][0]):.0f} / {max(rows['64'][1]):.0f}; causal 64: {max(rows['64c'][0]):.0f} / {max(rows['64c'][1]):.0f})")
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


def _op_cases(torch, dev) -> dict:
    """Memory-bound aten ops a training step spends its non-matmul time in, at a step's sizes (8,192 tokens of width
    2,048 in bf16; a 32k vocabulary's logits in fp32, as Hugging Face's loss upcasts them): name -> (op, args)."""
    a = torch.ops.aten
    N, H, V = 8192, 2048, 32768
    bf, f32 = torch.bfloat16, torch.float32
    x = torch.randn(N, H, device=dev, dtype=bf)
    y = torch.randn(N, H, device=dev, dtype=bf)
    x32 = torch.randn(N, H, device=dev, dtype=f32)
    w, b = torch.randn(H, device=dev, dtype=bf), torch.randn(H, device=dev, dtype=bf)
    rstd = torch.rand(N, 1, device=dev, dtype=f32)                      # one value per row
    logits = torch.randn(N // 2, V, device=dev, dtype=f32)
    logp = a._log_softmax.default(logits, -1, False)
    target = torch.randint(0, V, (N // 2,), device=dev)
    total = torch.tensor(float(N // 2), device=dev)
    idx = torch.randint(0, V, (N,), device=dev)
    img = torch.randn(64 * 784, 256, device=dev, dtype=bf)          # BatchNorm1d's (N, C); 4-D ones: _batch_norm_cases
    qkv = torch.randn(4, 1024, 3 * H, device=dev, dtype=bf)         # a fused projection's output, 4 x 1,024 tokens
    heads = qkv[..., H:2 * H].view(4, 1024, H // 64, 64).transpose(1, 2)   # its keys as heads: runs of 64
    heads2 = qkv[..., :H].view(4, 1024, H // 64, 64).transpose(1, 2)      # its queries alike
    cos = torch.randn(4, 1, 1024, 64, device=dev, dtype=bf)              # RoPE's cos, broadcast over the heads
    cw, cb = torch.ones(256, device=dev), torch.zeros(256, device=dev)
    rm, rv = torch.zeros(256, device=dev), torch.ones(256, device=dev)
    bn, bn_mean, bn_rstd = a.native_batch_norm.default(img, cw, cb, rm, rv, True, 0.1, 1e-5)
    return {
        **_batch_norm_cases(torch, dev),
        **_softmax_row_cases(torch, dev),
        **_layer_norm_cases(torch, dev),
        **_conv_and_norm_cases(torch, dev),
        "native_batch_norm": (a.native_batch_norm.default, (img, cw, cb, rm, rv, True, 0.1, 1e-5)),
        "native_batch_norm_backward": (a.native_batch_norm_backward.default,
                                       (img, img, cw, rm, rv, bn_mean, bn_rstd, True, 1e-5, [True, True, True])),
        "nll_loss_forward": (a.nll_loss_forward.default, (logp, target, None, 1, -100)),
        "nll_loss_backward": (a.nll_loss_backward.default, (total, logp, target, None, 1, -100, total)),
        "sum": (a.sum.dim_IntList, (x, [0])),
        "mean": (a.mean.dim, (x32, [-1], True)),
        "cat": (a.cat.default, ([x, y], -1)),
        "cat/strided": (a.cat.default, ([x[:, H // 2:], y[:, : H // 2]], -1)),      # RoPE's rotate_half
        "cat/heads": (a.cat.default, ([heads[..., 32:], heads[..., :32]], -1)),   # RoPE's rotate_half on heads
        "cat/one": (a.cat.default, ([torch.tensor([], device=dev, dtype=bf), heads.contiguous()], -2)),   # KV cache update
        "slice_backward": (a.slice_backward.default, (heads[..., :32].contiguous(), list(heads.shape), -1, 0, 32, 1)),
        #                  RoPE's rotate_half backward: a half of each head's gradient into zeros (the fill taken off)
        "clone/heads": (a.clone.default, (heads,)),                               # .contiguous() of heads
        "mul/heads": (a.mul.Tensor, (heads, cos)),                                # RoPE: k * cos
        "add/heads": (a.add.Tensor, (heads, heads2)),                             # RoPE: k * cos + rotate_half(k) * sin
        "mul": (a.mul.Tensor, (x, y)),
        "mul/bcast": (a.mul.Tensor, (x, w)),                                       # a norm's weight
        "mul/rows": (a.mul.Tensor, (x32, rstd)),                                   # RMSNorm: x * rsqrt(var), fp32
        "mul/strided": (a.mul.Tensor, (x.t(), y.t())),
        "add": (a.add.Tensor, (x, y)),
        "add/bcast": (a.add.Tensor, (x, b)),
        "add/mixed": (a.add.Tensor, (x32, x)),          # autocast's residual: the fp32 stream plus a bf16 projection
        "mul/mixed": (a.mul.Tensor, (x32, x)),
        "native_dropout": (a.native_dropout.default, (x32, 0.1, True)),   # GPT-2's 0.1 on its fp32 stream (RNG + mask)
        "_to_copy": (a._to_copy.default, (x32,), {"dtype": bf}),
        "_to_copy/strided": (a._to_copy.default, (x32.t(),), {"dtype": bf}),
        "_to_copy/up": (a._to_copy.default, (x,), {"dtype": f32}),                 # x.float(): bf16 -> fp32
        "copy_/up": (a.copy_.default, (x32, x)),                                   # into an fp32 buffer
        "clone/strided": (a.clone.default, (x.view(N, 16, H // 16).transpose(0, 1),)),   # .contiguous() of a transpose
        "copy_": (a.copy_.default, (x, x32)),
        "pow": (a.pow.Tensor_Scalar, (x32, 2)),
        "silu_backward": (a.silu_backward.default, (x, y)),
        "embedding_dense_backward/rows": (a.embedding_dense_backward.default, (x, idx, V, -1, False)),   # EMBEDDING_CAL
        "fill_": (a.fill_.Scalar, (logits, 0.0)),
    }


ROW_CASE_BYTES = 2**26   # each width's input in the by-width cases (softmax, layer norm): 64 MiB, and 256 rows at least
ROW_CASE_MIN_ROWS = 256  # (a block a row: every SM busy)


def _softmax_row_cases(torch, dev) -> dict:
    """The four softmax ops over rows of each width of ``ops_kinds.SOFTMAX_WIDTHS``, in fp32 and bf16 (about 3 GiB in all;
    one output stands for both backwards' outputs: their values do not change the time): ``_log_softmax/w<W>`` and
    ``_log_softmax/w<W>/16bit`` (the rate moves with the row's width: memlens.estimator.timing.ops)."""
    from ..estimator.timing.ops_kinds import HALF_ROWS, SOFTMAX_WIDTHS

    a, out = torch.ops.aten, {}
    for dtype, tag in ((torch.float32, ""), (torch.bfloat16, HALF_ROWS)):
        for w in SOFTMAX_WIDTHS:
            x = torch.randn(max(ROW_CASE_MIN_ROWS, ROW_CASE_BYTES // (w * dtype.itemsize)), w, device=dev, dtype=dtype)
            y = a._softmax.default(x, -1, False)
            out[f"_log_softmax/w{w}{tag}"] = (a._log_softmax.default, (x, -1, False))
            out[f"_log_softmax_backward_data/w{w}{tag}"] = (a._log_softmax_backward_data.default, (x, y, -1, dtype))
            out[f"_softmax/w{w}{tag}"] = (a._softmax.default, (x, -1, False))
            out[f"_softmax_backward_data/w{w}{tag}"] = (a._softmax_backward_data.default, (x, y, -1, dtype))
    return out


def _layer_norm_cases(torch, dev) -> dict:
    """Layer norm forward and backward over rows of each width of ``ops_kinds.LAYER_NORM_WIDTHS``, bf16 and fp32 (with
    fp32 weights, as autocast runs it), 64 MiB of input each: ``native_layer_norm/w<W>`` and ``.../w<W>/fp32``."""
    from ..estimator.timing.ops import FP32
    from ..estimator.timing.ops_kinds import LAYER_NORM_WIDTHS

    a, out = torch.ops.aten, {}
    for (dtype, tag), width in itertools.product(((torch.bfloat16, ""), (torch.float32, FP32)), LAYER_NORM_WIDTHS):
        x = torch.randn(max(ROW_CASE_MIN_ROWS, ROW_CASE_BYTES // (width * dtype.itemsize)), width, device=dev, dtype=dtype)
        w, b = torch.ones(width, device=dev, dtype=dtype), torch.zeros(width, device=dev, dtype=dtype)
        _, mean, rstd = a.native_layer_norm.default(x, [width], w, b, 1e-5)
        out[f"native_layer_norm/w{width}{tag}"] = (a.native_layer_norm.default, (x, [width], w, b, 1e-5))
        out[f"native_layer_norm_backward/w{width}{tag}"] = (a.native_layer_norm_backward.default,
                                                            (x, x, [width], mean, rstd, w, b, [True, True, True]))
    return out


def _conv_and_norm_cases(torch, dev) -> dict:
    """A depthwise 7 x 7 convolution at ConvNeXt-T's first stage (bf16 [64, 96, 56, 56]: no GEMM, CUDA cores),
    forward and backward, over NCHW and channels-last inputs; group norm over a Stable Diffusion UNet's first block ([8, 320, 64, 64], 32 groups) in bf16
    and fp32 (autocast runs it in fp32); ResNet's stem max-pool's backward ([64, 64, 112, 112], 3 x 3, stride 2)."""
    a = torch.ops.aten
    x = torch.randn(64, 96, 56, 56, device=dev, dtype=torch.bfloat16)
    w = torch.randn(96, 1, 7, 7, device=dev, dtype=torch.bfloat16)
    conv = (x, w, None, [1, 1], [3, 3], [1, 1], False, [0, 0], 96)
    y = a.convolution.default(*conv)
    xl = x.contiguous(memory_format=torch.channels_last)      # Hugging Face's ConvNeXt feeds them channels-last
    yl = a.convolution.default(xl, *conv[1:])
    out = {"convolution/depthwise": (a.convolution.default, conv),
           "convolution_backward/depthwise": (a.convolution_backward.default,
                                              (y, x, w, [96], [1, 1], [3, 3], [1, 1], False, [0, 0], 96, [True, True, False])),
           "convolution/depthwise/nhwc": (a.convolution.default, (xl, *conv[1:])),
           "convolution_backward/depthwise/nhwc": (a.convolution_backward.default,
                                                   (yl, xl, w, [96], [1, 1], [3, 3], [1, 1], False, [0, 0], 96,
                                                    [True, True, False]))}
    for dtype, tag in ((torch.bfloat16, ""), (torch.float32, "/fp32")):
        g = torch.randn(8, 320, 64, 64, device=dev, dtype=dtype)
        gw, gb = torch.ones(320, device=dev, dtype=dtype), torch.zeros(320, device=dev, dtype=dtype)
        _, gm, gr = a.native_group_norm.default(g, gw, gb, 8, 320, 64 * 64, 32, 1e-5)
        out[f"native_group_norm{tag}"] = (a.native_group_norm.default, (g, gw, gb, 8, 320, 64 * 64, 32, 1e-5))
        out[f"native_group_norm_backward{tag}"] = (a.native_group_norm_backward.default,
                                                  (g, g, gm, gr, gw, 8, 320, 64 * 64, 32, [True, True, True]))
    p = torch.randn(64, 64, 112, 112, device=dev, dtype=torch.bfloat16)
    pooled, idx = a.max_pool2d_with_indices.default(p, [3, 3], [2, 2], [1, 1])
    out["max_pool2d_with_indices_backward"] = (a.max_pool2d_with_indices_backward.default,
                                               (pooled, p, [3, 3], [2, 2], [1, 1], [1, 1], False, idx))
    return out


BN_BATCH = 64   # the batch of _batch_norm_cases' images (the per-channel reductions run over batch x H x W)


def _batch_norm_cases(torch, dev) -> dict:
    """Batch norm forward and backward at each spatial size of ``ops.BN_SPATIAL``, on ResNet-50's stage shapes at batch
    64 (the channels grow as the images shrink), in bf16 and fp32: ``native_batch_norm/hw<S>``, ``.../hw<S>/fp32``."""
    from ..estimator.timing.ops import BN_SPATIAL, FP32

    a, out = torch.ops.aten, {}
    for (hw, c), (dtype, tag) in itertools.product(zip(BN_SPATIAL, (64, 256, 512, 1024, 2048)),
                                                   ((torch.bfloat16, ""), (torch.float32, FP32))):
        side = int(round(hw ** 0.5))
        x = torch.randn(BN_BATCH, c, side, side, device=dev, dtype=dtype)
        w, b = torch.ones(c, device=dev), torch.zeros(c, device=dev)
        rm, rv = torch.zeros(c, device=dev), torch.ones(c, device=dev)
        _, mean, rstd = a.native_batch_norm.default(x, w, b, rm, rv, True, 0.1, 1e-5)
        fwd, bwd = _cudnn_batch_norm(torch, x, w, b, rm, rv)
        out[f"native_batch_norm/hw{hw}{tag}"] = (a.native_batch_norm.default, (x, w, b, rm, rv, True, 0.1, 1e-5), {}, fwd)
        out[f"native_batch_norm_backward/hw{hw}{tag}"] = (a.native_batch_norm_backward.default,
                                                          (x, x, w, rm, rv, mean, rstd, True, 1e-5, [True, True, True]),
                                                          {}, bwd)
    return out


def _cudnn_batch_norm(torch, x, w, b, rm, rv):
    """What a CUDA GPU runs for ``F.batch_norm`` in training where cuDNN is on (``aten::cudnn_batch_norm`` and its
    backward; the simulation, on a CPU, records the op it decomposes to there, ``native_batch_norm``): callables timing
    them, or (None, None) where cuDNN does not run here (the native kernels are timed)."""
    if x.device.type != "cuda" or not torch.backends.cudnn.is_available() or not torch.backends.cudnn.enabled:
        return None, None
    a = torch.ops.aten
    try:
        y, save_mean, save_var, reserve = a.cudnn_batch_norm.default(x, w, b, rm, rv, True, 0.1, 1e-5)
        grad = torch.randn_like(y)
        a.cudnn_batch_norm_backward.default(x, grad, w, rm, rv, save_mean, save_var, 1e-5, reserve)
    except RuntimeError:   # a layout or dtype this cuDNN does not take: the native kernels, as PyTorch falls back
        return None, None
    return (lambda: a.cudnn_batch_norm.default(x, w, b, rm, rv, True, 0.1, 1e-5),
            lambda: a.cudnn_batch_norm_backward.default(x, grad, w, rm, rv, save_mean, save_var, 1e-5, reserve))


def measure_op_ratios(torch, dev, bandwidth: dict, log) -> dict:
    """Each op of :func:`_op_cases` (``name -> (op, args[, kwargs[, run]])``: ``run`` what the GPU runs for that op
    where it is another kernel than the op's own - cuDNN's batch norm), the bytes the time model counts for it
    (memlens.estimator.timing.ops), over its measured time, over the copy's bandwidth at those bytes: how much faster (> 1: a gather reads one element a row)
    or slower (< 1: a softmax reads its input three times, a reduction across rows) it runs than a copy."""
    from ..estimator.timing.ops import op_facts
    from ..estimator.timing.tables import TimingTable

    bw = TimingTable(gpu="x", bandwidth=dict(bandwidth))
    bw.bandwidth["log_gbps"] = [math.log(max(v, 1e-6)) for v in bandwidth["gbps"]]
    out, timed = {}, {}
    for name, case in _op_cases(torch, dev).items():
        func, args = case[0], case[1]
        kwargs = case[2] if len(case) > 2 else {}
        run = case[3] if len(case) > 3 and case[3] is not None else (lambda: func(*args, **kwargs))
        try:
            res = func(*args, **kwargs)
            sec = _gpu_seconds(torch, run)
        except RuntimeError as e:   # an op this build does not have for these arguments: priced as a copy
            log(f"op {name}: not measured ({str(e).splitlines()[0][:80]})")
            continue
        facts = op_facts(func, args, kwargs, res)
        if facts.op != name:   # the key the time model looks up for this op and layout must be the one measured
            log(f"op {name}: not kept (the time model reads these inputs as {facts.op})")
            continue
        timed[name] = (facts, sec)
    for name, (facts, sec) in sorted(timed.items(), key=lambda kv: bool(kv[1][0].fill)):   # the fill_ ratio first
        if facts.fill:   # an op that zero-fills its output first: its own kernels' time, the fill priced as the time model does
            bw.op_ratio = out
            sec -= bw.op_seconds("fill_", facts.fill)
            if sec <= 0:
                log(f"op {name}: not kept (its zero-fill alone priced at its whole time)")
                continue
        nbytes = facts.nbytes
        out[name] = round(min(50.0, max(0.002, nbytes / sec / 1e9 / bw.bandwidth_gbps(nbytes))), 4)
    torch.cuda.empty_cache()
    log(f"memory-bound ops against a copy: {out}")
    return out


GROUPED_MM_CASE = (16384, 64, 2048, 2048)   # rows (2,048 tokens x top-8), experts, K, N: OLMoE-1B-7B's up projection


def measure_grouped_mm(torch, dev, table, log) -> dict:
    """``torch._grouped_mm`` over a mixture of experts' shape (``GROUPED_MM_CASE``, bf16, the rows split over the
    experts as a router's random choice splits them): its rate over what ``table``'s dense grid prices for the same
    FLOPs with each group's last tile half empty (memlens.estimator.timing.ops._grouped_mm_facts), as
    ``op_ratio["_grouped_mm"]``; nothing where this build of torch has no grouped GEMM for this GPU."""
    from ..estimator.timing.ops import op_facts

    rows, groups, k, n = GROUPED_MM_CASE
    a = torch.ops.aten
    x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(groups, n, k, device=dev, dtype=torch.bfloat16).transpose(-2, -1)   # as nn.Parameter [E, N, K].T
    gen = torch.Generator(device="cpu").manual_seed(0)
    counts = torch.bincount(torch.randint(0, groups, (rows,), generator=gen), minlength=groups)
    offs = torch.cumsum(counts, 0).to(device=dev, dtype=torch.int32)
    try:
        out = a._grouped_mm.default(x, w, offs)
        sec = _gpu_seconds(torch, lambda: a._grouped_mm.default(x, w, offs))
    except (RuntimeError, AttributeError) as e:   # no grouped GEMM here (before sm90 in some builds): priced dense
        log(f"grouped GEMM: not measured ({str(e).splitlines()[0][:80]})")
        return {}
    f = op_facts(a._grouped_mm.default, (x, w, offs), {}, out)
    dense = f.flops * f.pad / (table.matmul_tflops("bfloat16", *f.mnk) * 1e12)
    ratio = round(dense / sec, 4)
    log(f"grouped GEMM {rows} x {k} x {n} over {groups} experts: {f.flops / sec / 1e12:.0f} TFLOP/s, {ratio} of the "
        f"dense grid's rate with half a tile of padding per expert")
    return {"_grouped_mm": ratio}


def measure_optimizer_ratios(torch, dev, table, log) -> dict:
    """A real optimizer step (torch.optim.AdamW foreach and fused, SGD) over 64 bf16 tensors of 4M elements, over what
    the time model's traffic formula (memlens.estimator.timing.step.optimizer_seconds) prices for it with this table."""
    from ..core.spec import TrainingSpec
    from ..estimator.timing.step import optimizer_seconds

    params = [torch.nn.Parameter(torch.randn(4 * 2**20, device=dev, dtype=torch.bfloat16)) for _ in range(64)]
    for p in params:
        p.grad = torch.randn_like(p)
    n = sum(p.numel() for p in params)
    out = {}
    for name, make in (("adamw", lambda: torch.optim.AdamW(params, lr=1e-4, foreach=True)),
                       ("adamw-fused", lambda: torch.optim.AdamW(params, lr=1e-4, fused=True)),
                       ("sgd", lambda: torch.optim.SGD(params, lr=1e-4, foreach=True))):
        opt = make()
        measured = _gpu_seconds(torch, opt.step, budget_s=0.1)
        model, _ = optimizer_seconds(TrainingSpec(model="gpt2", precision="bf16", optimizer=name), n, len(params), table)
        out[name] = round(measured / model, 3) if model else 1.0
        del opt
    del params
    torch.cuda.empty_cache()
    log(f"optimizer step against the traffic model: {out}")
    return out


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

    def chain_backward() -> float:
        y = chain()
        torch.cuda.synchronize()
        t = time.perf_counter()
        y.backward()
        torch.cuda.synchronize()
        return time.perf_counter() - t

    chain_backward()
    backward = statistics.median(chain_backward() for _ in range(15)) / 201 * 1e6   # one backward alone is noise
    ts = [torch.ones(1024, device=dev) for _ in range(100)]
    optimizer = host_us(lambda: torch._foreach_add_(ts, 1.0), 300)
    host = {"forward": round(forward, 2), "backward": round(backward, 2), "optimizer": round(optimizer, 2), "view": round(view, 2)}
    log(f"kernel floor {floor:.2f} us; host per op {host}")
    return round(floor, 3), host


def measure_model_host(torch, dev, host: dict, log, speeds: list | None = None) -> dict:
    """The host's µs per op inside a real model's step: a 16-layer Llama of width 64 from transformers (eager
    Python, module calls, bf16) at 1 x 16 tokens, so small that the GPU idles and the wall time is the host's. Its
    ops are counted as the simulation's trace counts them (every aten op under a dispatch mode; views and allocations
    at the ``view`` cost): the rest is the cost per kernel-launching op. Once as it is (``model_forward``, the autograd
    engine's ``model_backward``), then with every layer under memlens' full (``_ckpt``) and selective (``_sac``)
    checkpointing: the forward under checkpoint's hooks (``model_forward_ckpt`` / ``_sac``) and the recomputed ops,
    what backward adds over the plain backward per op it adds (``model_recompute_ckpt`` / ``_sac``)."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM  # optional: the model-level host cost needs it
    except ImportError:
        return {}
    from ..models.checkpoint import checkpoint_blocks

    cfg = LlamaConfig(**CALIB_LLAMA)
    ids = torch.randint(0, 512, (1, 16), device=dev)
    v = host.get("view", 0.0) * 1e-6
    models = {}
    for suffix, policy in (("", None), ("_ckpt", "full"), ("_sac", "selective")):
        models[suffix] = LlamaForCausalLM(cfg).to(dev, torch.bfloat16).train()
        if policy:
            checkpoint_blocks(models[suffix], "all", policy)
    timed = host_rounds(torch, models, ids, speeds=speeds)   # interleaved: the host's drift hits all three alike
    del models
    out, plain = {}, None
    for suffix in ("", "_ckpt", "_sac"):
        f, b, nf, nb = timed[suffix]
        out["model_forward" + (suffix or "")] = round(max(0.0, f - nf["view"] * v) / max(1, nf["kernel"]) * 1e6, 2)
        if plain is None:
            plain = (b, nb)
            out["model_backward"] = round(max(0.0, b - nb["view"] * v) / max(1, nb["kernel"]) * 1e6, 2)
            continue
        extra = {k: nb[k] - plain[1][k] for k in nb}
        rec = (b - plain[0] - extra["view"] * v) / max(1, extra["kernel"])
        out["model_recompute" + suffix] = round(max(0.0, rec) * 1e6, 2)
        if suffix == "_ckpt":   # full checkpointing's work per checkpointed call (every layer here)
            out.update(ckpt_layer_costs(timed[""], timed["_ckpt"], cfg.num_hidden_layers, out["model_forward"] * 1e-6, v))
    log(f"host per op in a model's step (us): {out}")
    return out


def measure_dp_host(torch, dev, host: dict, log, speeds: list | None = None) -> dict:
    """Opacus' per-sample-gradient hooks per hooked module (µs): calibrate's 16-layer Llama with peft's LoRA (r 8 on
    q_proj and v_proj: 64 adapter linears) at 1 x 16 tokens, bare and in Opacus' GradSampleModule (hooks mode), timed
    in interleaved rounds (:func:`host_rounds`): what each hooked module's call adds to forward
    (``hooked_module_forward``: capture_activations_hook, nn.Module's BackwardHook around its inputs and outputs) and
    to backward (``hooked_module_backward``: the backward hook's Python around the per-sample gradient's ops, which
    the trace prices as ops). Needs opacus and peft: {} without them."""
    import warnings

    try:
        from opacus import GradSampleModule
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return {}
    cfg = LlamaConfig(**CALIB_LLAMA)
    models = {}
    for name in ("", "_dp"):
        torch.manual_seed(0)
        m = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=8, target_modules=["q_proj", "v_proj"])).to(dev).train()
        if name:
            m = GradSampleModule(m, batch_first=True, loss_reduction="mean")

            def zero_grad(set_to_none=True, m=m):    # the per-sample gradients go as Opacus' optimizer clears them
                for p in m.parameters():
                    p.grad = None
                    if hasattr(p, "grad_sample"):
                        p.grad_sample = None
            m.zero_grad = zero_grad
        models[name] = m
    hooked = sum(1 for mod in models["_dp"].modules() if mod._backward_hooks)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        out = per_call_costs(torch, dev, models, hooked, host, ("hooked_module_forward", "hooked_module_backward"), speeds)
    log(f"Opacus' hooks per hooked module ({hooked} modules, us): {out}")
    return out


def per_call_costs(torch, dev, models: dict, calls: int, host: dict, keys: tuple, speeds: list | None = None) -> dict:
    """Two models (bare, then wrapped: name -> model) timed at 1 x 16 tokens in interleaved rounds (:func:`host_rounds`):
    what each of the wrapped one's ``calls`` adds to forward and backward beyond the ops it adds (priced at the table's
    ``host`` costs so far), in µs, as ``keys`` (forward key, backward key)."""
    ids = torch.randint(0, 512, (1, 16), device=dev)
    (bare, wrapped) = list(models)
    timed = host_rounds(torch, models, ids, speeds=speeds)
    fwd, bwd = extra_per_call(timed[bare], timed[wrapped], calls, host.get("model_forward", 0.0) * 1e-6,
                              host.get("model_backward", 0.0) * 1e-6, host.get("view", 0.0) * 1e-6)
    return {keys[0]: fwd, keys[1]: bwd}


def measure_qlora_host(torch, dev, host: dict, log, speeds: list | None = None) -> dict:
    """bitsandbytes' 4-bit layers on the host, per layer call (µs): calibrate's 16-layer Llama in bf16 at 1 x 16 tokens
    with its linears frozen, bare and with every one of them but the head bitsandbytes' Linear4bit
    (:func:`memlens.models.quant.quantize_with_bitsandbytes`: 112 layers), timed in interleaved rounds
    (:func:`host_rounds`): what each 4-bit layer's call adds to forward (``qlora_layer_forward``: Linear4bit.forward,
    matmul_4bit, the quant state's absmax and weight dequantized) and to backward (``qlora_layer_backward``: the weight
    dequantized again for the input's gradient), beyond the ops it dispatches. Needs bitsandbytes and a GPU: {}
    without them."""
    if dev.type != "cuda":
        return {}
    try:
        import bitsandbytes  # noqa: F401  optional: the 4-bit layers' own host cost needs it
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return {}
    from ..models.quant import quantize_with_bitsandbytes

    cfg = LlamaConfig(**CALIB_LLAMA)
    models = {}
    for name in ("plain", "4bit"):
        torch.manual_seed(0)
        m = LlamaForCausalLM(cfg).to(dev, torch.bfloat16).train()
        for mod in m.modules():    # frozen linears both ways (QLoRA's base): backward computes their inputs' gradients
            if type(mod) is torch.nn.Linear and mod is not m.lm_head:
                mod.weight.requires_grad_(False)
        if name == "4bit":
            quantize_with_bitsandbytes(m, torch.bfloat16)
        models[name] = m
    layers = sum(1 for mod in models["4bit"].modules() if type(mod).__name__ == "Linear4bit")
    out = per_call_costs(torch, dev, models, layers, host, ("qlora_layer_forward", "qlora_layer_backward"), speeds)
    log(f"bitsandbytes' 4-bit layers per call ({layers} layers, us): {out}")
    return out


def extra_per_call(plain: tuple, other: tuple, calls: int, fwd_op: float, bwd_op: float, view: float) -> tuple:
    """(forward µs, backward µs) per call of what ``other`` adds over ``plain`` (each (forward s, backward s, forward
    ops, backward ops)) beyond the ops it adds (``fwd_op`` / ``bwd_op`` each, ``view`` a view), over ``calls``."""
    (f0, b0, nf0, nb0), (f1, b1, nf1, nb1) = plain, other
    fwd = f1 - f0 - (nf1["kernel"] - nf0["kernel"]) * fwd_op - (nf1["view"] - nf0["view"]) * view
    bwd = b1 - b0 - (nb1["kernel"] - nb0["kernel"]) * bwd_op - (nb1["view"] - nb0["view"]) * view
    return round(max(0.0, fwd) / max(1, calls) * 1e6, 2), round(max(0.0, bwd) / max(1, calls) * 1e6, 2)


def ckpt_layer_costs(plain: tuple, ckpt: tuple, layers: int, per_op: float, view: float) -> dict:
    """Full checkpointing's host work per checkpointed call (µs), from the same model timed bare and with every one of
    its ``layers`` checkpointed ((forward s, backward s, forward ops, backward ops) each): the forward's extra time
    beyond its ops' own difference, and backward's beyond re-running the recomputed ops (``per_op``: a forward op's
    cost in a model, module calls included; ``view`` a view). Per call, not per op: on an H100 host a 24-layer ViT of
    12 kernel ops a layer paid 864 and 1,379 us a layer, calibrate's Llama of 42 ops 898 and 1,400
    (bench/results/raw/ckpt_probe/; priced at each checkpointed call: memlens.estimator.timing.record.price)."""
    fwd, rec = extra_per_call(plain, ckpt, layers, per_op, per_op, view)
    return {"ckpt_layer_forward": fwd, "ckpt_layer_recompute": rec}


HOST_DRIFT = 1.3   # the fastest and slowest rounds' host speeds further apart than this: said so


def host_drift_note(speeds: list[float]) -> str | None:
    """A line when the host's speed (memlens.measure.host_phases.host_speed, seconds per round) varied by more than
    :data:`HOST_DRIFT` while calibrate measured its host costs: a shared or throttled CPU, whose host-bound steps vary
    as much (bench/results/host_probe.md: 13 to 30 ms on one GPU machine within minutes)."""
    lo, hi = min(speeds), max(speeds)
    if lo <= 0 or hi / lo <= HOST_DRIFT:
        return None
    return (f"note: this host's speed varied {hi / lo:.1f}x while its per-op costs were measured (a shared or throttled "
            f"CPU): the table keeps the median; steps that wait on the host will vary about as much")


def measure_pcie(torch, dev, log) -> dict:
    n = 256 * 2**20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    d = torch.empty(n, dtype=torch.uint8, device=dev)
    h2d = n / _gpu_seconds(torch, lambda: d.copy_(host, non_blocking=True), budget_s=0.1) / 1e9
    d2h = n / _gpu_seconds(torch, lambda: host.copy_(d, non_blocking=True), budget_s=0.1) / 1e9
    log(f"PCIe h2d {h2d:.1f} GB/s, d2h {d2h:.1f} GB/s")
    return {"h2d": round(h2d, 2), "d2h": round(d2h, 2)}


def ranks_section(t: TimingTable, torch, world: int, nccl: bool, quick: bool, log) -> None:
    """The table's multi-GPU part: measured over the ``world`` GPUs here (memlens.measure.calibrate_nccl) where there
    are several and ``nccl``, else data-sheet NCCL rows; a failed measurement (a busy GPU, NCCL) keeps the rest of the
    table and says so."""
    ranks = None
    if nccl and world > 1:
        try:
            ranks = measure_ranks(torch, world, GRID_NCCL if not quick else GRID_NCCL[::3], t.host_us, log)
        except Exception as e:  # noqa: BLE001 - a process per GPU failed: the one-GPU table is kept
            why = (str(e).strip().splitlines() or [""])[-1][:160]
            log(f"NCCL over {world} GPUs not measured ({type(e).__name__}: {why}); its rows are data-sheet rates "
                "(--no-nccl skips it)")
    if ranks is not None:
        t.nccl, t.nccl_overlap = ranks["nccl"], ranks["overlap"]
        t.host_us.update(ranks["host_us"])
        t.env["fsdp_ranks"] = world
        t.env["nccl"] = f"measured over {world} GPUs (memlens.measure.calibrate_nccl)"
        return
    from ..estimator.timing.tables import _datasheet_nccl

    t.nccl = {str(w): _datasheet_nccl(t.gpu, w) for w in (2, 4, 8)} if t.gpu in GPUS else {}
    t.env["nccl"] = "data sheet (one GPU here)" if world <= 1 or not nccl else "data sheet (not measured here)"


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
    t.env[MATMUL_TIMER] = matmul_timer()
    t.attention = measure_attention(torch, dev, seqs, log)
    t.bandwidth = measure_bandwidth(torch, dev, sizes, log)
    t.min_kernel_us, t.host_us = measure_host(torch, dev, log)
    speeds: list = []
    t.host_us.update(measure_model_host(torch, dev, t.host_us, log, speeds))
    t.host_us.update(measure_dp_host(torch, dev, t.host_us, log, speeds))
    t.host_us.update(measure_qlora_host(torch, dev, t.host_us, log, speeds))
    if speeds:   # the host's speed while its costs were measured (a fixed Python loop, ms): how far it drifted
        t.env["host_speed_ms"] = [round(min(speeds) * 1e3, 2), round(statistics.median(speeds) * 1e3, 2),
                                  round(max(speeds) * 1e3, 2)]
        drift = host_drift_note(speeds)
        if drift:
            log(drift)
    t.host_us.update(measure_fsdp_host(torch, dev, t.host_us, log))
    t.matmul_unaligned, t.matmul_unaligned_out = measure_matmul_unaligned(torch, dev, log)
    t.op_ratio = measure_op_ratios(torch, dev, t.bandwidth, log)
    _add_logs(t)
    t.op_ratio.update(measure_grouped_mm(torch, dev, t, log))
    t.optimizer_ratio = measure_optimizer_ratios(torch, dev, t, log)
    t.pcie_gbps = measure_pcie(torch, dev, log)
    ranks_section(t, torch, torch.cuda.device_count(), nccl, quick, log)
    t.env["seconds"] = round(time.perf_counter() - t0, 1)
    _add_logs(t)
    log(f"calibrated in {t.env['seconds']} s")
    return t
