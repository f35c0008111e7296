"""Timing tables: what one GPU does per second, by shape (matmuls, attention), by size (memory traffic,
collectives) and per op (launch and host dispatch costs). One JSON file per GPU.

A table is *calibrated* when ``memlens calibrate`` (memlens.measure.calibrate) measured it on that GPU; the
built-in tables under ``memlens/data/gpus/<gpu>_timing.json`` are, once the lead commits them. Any other GPU
(and a CPU-only machine without a file) gets a table derived from the data sheet (memlens.core.gpus facts,
typical efficiencies below), marked ``"calibrated": false`` and said so wherever a time is shown.

Rates are interpolated in log space: a matmul's TFLOP/s over a log2 grid of (M, N, K) (trilinear in
log2 of each dimension, log of the rate), bandwidth over log2 bytes, collective bus bandwidth over log2 bytes;
outside a grid the nearest edge holds (the kernel floor, ``min_kernel_us``, bounds small ops from below).

>>> t = datasheet_table("h100")
>>> t.calibrated, round(t.matmul_tflops("bfloat16", 8192, 8192, 8192))
(False, 690)
>>> t2 = TimingTable.from_dict(t.to_dict()); t2.matmul_tflops("bfloat16", 8192, 8192, 8192) == t.matmul_tflops("bfloat16", 8192, 8192, 8192)
True
"""
from __future__ import annotations

import json
import math
import os
from bisect import bisect_right
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ...core.errors import SpecError
from ...core.gpus import GPUS, gpu_facts
from .ops_kinds import LAYER_NORM_OPS, SOFTMAX_OPS

FORMAT = 1
DTYPES = ("bfloat16", "float16", "float32", "tf32")
DATA_DIR = Path(__file__).resolve().parents[2] / "data" / "gpus"
ENV_TABLE = "MEMLENS_TIMING_TABLE"     # a user's table file (the CLI's --timing-table sets it; workers inherit it)
# env key of how calibrate timed the GEMM grids (memlens.measure.calibrate.matmul_timer); a calibrated table without it
# timed every GEMM over 2e9 FLOPs from a Python loop, so a mid-size one (10-50 us) at the host's pace: its rate up to
# 5x low (bf16 1024^3 on an H200: 73 TFLOP/s so, 375 graph-timed; bench/results/bandwidth_probe.md, fourteenth section)
MATMUL_TIMER = "matmul_timer"
# env key of what a table took from another GPU's table (borrow_rates), said in its note
BORROWED = "borrowed"
# the memory-bound ops and layouts calibrate measures a rate for (memlens.measure.calibrate._op_cases; a test keeps the
# two alike) past batch norm's spatial sizes and the softmax and layer-norm row widths: a calibrated table without some
# (calibrated before they were measured) prices each as its nearest (an upcast as a cast, ``/heads`` as ``/strided``,
# ``/rows`` as ``/bcast``, ``cat/one`` as ``cat/heads``, a softmax or layer norm over rows of some width as the op's
# one measured width, else the op or a copy: ``/mixed`` as the op) and says how many it lacks
_NEAREST_LAYOUT = {"heads": "strided", "rows": "bcast", "one": "heads"}   # a layout calibrate measures now -> the one measured before it
CALIBRATED_OPS = frozenset({
    "native_batch_norm", "native_batch_norm_backward", "nll_loss_forward", "nll_loss_backward", "sum", "mean", "cat",
    "cat/strided", "cat/heads", "clone/heads", "mul/heads", "add/heads", "mul", "mul/bcast", "mul/rows", "mul/strided",
    "add", "add/bcast", "_to_copy", "_to_copy/strided", "_to_copy/up", "copy_/up", "clone/strided", "copy_", "pow",
    "silu_backward", "embedding_dense_backward/rows", "fill_", "add/mixed", "mul/mixed", "native_dropout", "cat/one",
    "slice_backward", "convolution/depthwise", "convolution_backward/depthwise", "convolution/depthwise/nhwc",
    "convolution_backward/depthwise/nhwc", "native_group_norm", "native_group_norm_backward", "native_group_norm/fp32",
    "native_group_norm_backward/fp32", "max_pool2d_with_indices_backward", "_grouped_mm"})

# The grids calibrate measures and the data-sheet tables fill (log2-spaced).
GRID_M = (16, 64, 256, 1024, 4096, 16384, 65536)
# N and K reach 8 and 16: a LoRA adapter's GEMMs have its rank as one dimension, and cuBLAS runs them far under the
# bytes they move ([16384, 2048] @ [2048, 16] and its backward forms 62-107 us on an H200 where a copy of the same
# bytes takes 20: bench/results/bandwidth_probe.md); a grid starting at 64 priced them at the copy's rate
GRID_NK = (8, 16, 64, 256, 1024, 4096, 16384)
GRID_BYTES = tuple(2 ** e for e in range(12, 32, 2))        # 4 KiB .. 1 GiB
GRID_SEQ = (128, 512, 2048, 8192)
GRID_NCCL = tuple(2 ** e for e in range(16, 31, 2))         # 64 KiB .. 1 GiB

# fp32 without TF32 runs on the CUDA cores: the data sheets' FP32 (non-tensor) TFLOP/s (H100 SXM5 67, H200 67,
# A100 19.5, L40S 91.6, L4 30.3, A10 31.2, RTX 4090 82.6, RTX 3090 35.6, T4 8.1, V100 15.7)
FP32_SIMT_TFLOPS = {"h100": 67.0, "h200": 67.0, "a100-80gb": 19.5, "a100-40gb": 19.5, "l40s": 91.6, "l4": 30.3,
                    "a10g": 31.2, "rtx-4090": 82.6, "rtx-3090": 35.6, "t4": 8.1, "v100": 15.7}
# GPU-to-GPU bandwidth per direction, GB/s (data sheets: NVLink 4 on H100/H200 SXM 900 GB/s total, NVLink 3 on
# A100 SXM 600 GB/s total, V100 SXM2 300 GB/s total; the rest talk over PCIe: its per-direction figure)
NVLINK_GBPS = {"h100": 450.0, "h200": 450.0, "a100-80gb": 300.0, "a100-40gb": 300.0, "v100": 150.0}

# Typical efficiencies of a data-sheet table (assumptions, replaced by calibrate's measurements): a large bf16 GEMM
# reaches ~70% of the dense tensor-core peak on Hopper (cuBLAS), ~75% of the SIMT fp32 peak; copies ~85% of DRAM
# bandwidth; flash attention forward ~45% of the dense peak at long sequences, backward ~35%; NCCL ring bus
# bandwidth ~75% of the link.
EFF_MATMUL, EFF_SIMT, EFF_DRAM, EFF_ATTN_FWD, EFF_ATTN_BWD, EFF_LINK = 0.70, 0.75, 0.85, 0.45, 0.35, 0.75


@dataclass
class TimingTable:
    gpu: str                                  # the registry name it describes (memlens.core.gpus)
    device_name: str = ""                     # torch.cuda.get_device_name() where measured
    calibrated: bool = False                  # measured by `memlens calibrate` (False: data sheet)
    source: str = ""                          # how it was made
    matmul: dict = field(default_factory=dict)      # dtype -> {"m": [...], "n": [...], "k": [...], "tflops": [m][n][k]}
    matmul_unaligned: dict = field(default_factory=dict)   # the same for an input whose leading dim is off 16 bytes
    matmul_unaligned_out: dict = field(default_factory=dict)   # ... for an output whose leading dim is off
    attention: dict = field(default_factory=dict)   # dtype -> {"seq": [...], "fwd_tflops": [...], "bwd_tflops": [...]}
    #                                                 (head dim 128, no mask) + "variants": {"64", "64c", "128c": the
    #                                                 same rows at head dim 64 / with a causal mask}
    op_ratio: dict = field(default_factory=dict)    # aten op -> its measured rate / the copy's at the same bytes (a
    #                                                 softmax reads its input 3 times, a loss gathers one element a row)
    optimizer_ratio: dict = field(default_factory=dict)   # optimizer -> its measured step / the traffic model's
    bandwidth: dict = field(default_factory=dict)   # {"bytes": [...], "gbps": [...]}: bytes moved (read + written) per s
    min_kernel_us: float = 3.0                # GPU time of the smallest kernel, back to back (launch gap included)
    host_us: dict = field(default_factory=dict)     # host dispatch per op: forward (Python eager), backward (autograd
    #                                                 engine), optimizer (per foreach op), view (no kernel)
    pcie_gbps: dict = field(default_factory=dict)   # {"h2d": GB/s, "d2h": GB/s} pinned copies
    nccl: dict = field(default_factory=dict)        # str(world) -> {"all_reduce"|"all_gather"|"reduce_scatter": {"bytes": [...],
    #                                                 "busbw_gbps": [...], "latency_us": added per call}}
    nccl_overlap: dict = field(default_factory=dict)   # str(world) -> {"matmul"|"memory": the compute stream's extra seconds
    #                                                 per second of a collective beside it (memlens.measure.calibrate_nccl)}
    env: dict = field(default_factory=dict)         # torch / CUDA versions where measured
    format: int = FORMAT
    note: str = ""                                  # set at load time: calibrated or not, for this GPU or another
    _memo: dict = field(default_factory=dict, repr=False, compare=False)   # lookups already made

    # ------------------------------------------------------------ lookups
    def matmul_tflops(self, dtype: str, m: float, n: float, k: float, aligned: bool = True, out: bool = False) -> float:
        """TFLOP/s of one (M x K) @ (K x N) GEMM (a batched one: M counts every batch's rows); ``aligned=False``: a
        matrix's leading dimension is off 16 bytes, ``out``: the output's (the unaligned grids where measured for that
        dtype - the output's own where there is one - else the aligned one: calibrate measures the unaligned grids in
        16-bit only; fp32's CUDA-core GEMM ran GPT-2's unaligned 50,257-word head at its aligned rate, 51 TFLOP/s on an
        H200, where the 16-bit unaligned grid said 94)."""
        key = (dtype, m, n, k, aligned, out)
        hit = self._memo.get(key)
        if hit is None:
            grids = self.matmul
            if not aligned:
                un = (self.matmul_unaligned_out if out and self.matmul_unaligned_out else self.matmul_unaligned) or {}
                grids = un if dtype in un else grids
            g = grids.get(dtype) or grids.get("float32" if dtype == "tf32" else "bfloat16") or self.matmul.get(dtype) \
                or self.matmul.get("float32" if dtype == "tf32" else "bfloat16")
            hit = self._memo[key] = math.exp(_trilinear(g["m"], g["n"], g["k"], g["log_tflops"], m, n, k))
        return hit

    def attention_tflops(self, dtype: str, seq: float, backward: bool, head_dim: int = 128, causal: bool = False,
                         dropout: bool = False) -> float:
        """TFLOP/s of a fused attention kernel at query length ``seq``: the variant measured nearest the head dim (64
        or 128, log scale), with or without a causal mask, where calibrate measured them. A dtype calibrate does not
        measure attention in (fp32: the memory-efficient kernel on CUDA cores) runs at the 16-bit rate times the
        ratio of the two dtypes' large GEMMs in the same table. With ``dropout``: the variant measured with dropout
        (suffix ``d``: the kernel draws a Philox number per score and, backward, regenerates them), where the table has
        it; else the variant without (a table calibrated before this was measured)."""
        g = self.attention.get(dtype)
        scale = 1.0
        if g is None:   # fp32 attention (no tensor cores): the 16-bit kernel's rate scaled as the table's own GEMMs scale
            g = self.attention.get("bfloat16") or next(iter(self.attention.values()))
            big = (GRID_M[-2], GRID_NK[-2], GRID_NK[-2])
            scale = self.matmul_tflops(dtype, *big) / self.matmul_tflops("bfloat16", *big)
        var = g.get("variants") or {}
        hd = "64" if head_dim and head_dim < 91 else "128"
        name = hd + ("c" if causal else "")
        pick = (var.get(name + "d") if dropout else None) or var.get(name) or (var.get(hd) if hd != "128" else None) or g
        return scale * math.exp(_linear(g["seq"], pick["log_bwd" if backward else "log_fwd"], seq))

    def op_seconds(self, op: str, nbytes: float) -> float:
        """A memory-bound kernel: its bytes at the copy's bandwidth for that size, times the measured ratio of the op in
        that layout (``name/strided``, ``name/bcast``: memlens.estimator.timing.ops), else of the op, else 1."""
        ratio = self.op_ratio.get(op)
        if ratio is None and op.count("/") > 1:   # ``name/layout/dtype`` not measured: the layout's own (its other dtype)
            ratio = self.op_ratio.get(op.rsplit("/", 1)[0])
        if ratio is None:
            name, _, layout = op.partition("/")
            if layout in _NEAREST_LAYOUT:    # a table calibrated before this layout was told apart: the one it measured
                ratio = self.op_ratio.get(f"{name}/{_NEAREST_LAYOUT[layout]}")
            if ratio is None:    # a layout the table did not measure (``mul/bcast``): the op's own rate, else a copy's
                ratio = self.op_ratio.get(name, 1.0)
        return nbytes / (self.bandwidth_gbps(nbytes) * ratio * 1e9)

    def bandwidth_gbps(self, nbytes: float) -> float:
        hit = self._memo.get(nbytes)
        if hit is None:
            b = self.bandwidth
            hit = self._memo[nbytes] = math.exp(_linear(b["bytes"], b["log_gbps"], nbytes))
        return hit

    def kernel_seconds(self, flops: float = 0.0, rate_tflops: float = 0.0, nbytes: float = 0.0) -> float:
        """One kernel: the larger of its compute time and its memory time, never under the kernel floor."""
        t = flops / (rate_tflops * 1e12) if flops and rate_tflops else 0.0
        if nbytes:
            t = max(t, nbytes / (self.bandwidth_gbps(nbytes) * 1e9))
        return max(t, self.min_kernel_us * 1e-6)

    def collective_seconds(self, op: str, nbytes: float, world: int) -> float:
        """An NCCL all-reduce / all-gather / reduce-scatter of ``nbytes`` (the full buffer) over ``world`` ranks:
        the ring's bus-bandwidth law (nccl-tests PERFORMANCE.md: all-reduce moves 2(n-1)/n of the buffer per rank,
        all-gather and reduce-scatter (n-1)/n) at the table's bus bandwidth for that size."""
        if world <= 1 or nbytes <= 0:
            return 0.0
        rows = self.nccl.get(str(world)) or self.nccl.get(str(max((int(w) for w in self.nccl), default=2)))
        if not rows:
            rows = _datasheet_nccl(self.gpu, world)
        kind = op if op in rows else "all_reduce" if op == "all_reduce" else "all_gather"   # reduce-scatter: measured since
        r = rows[kind]
        busbw = math.exp(_linear(r["bytes"], r["log_busbw"], nbytes)) * 1e9
        factor = 2 * (world - 1) / world if kind == "all_reduce" else (world - 1) / world
        return nbytes * factor / busbw + r.get("latency_us", 15.0) * 1e-6

    def overlap_cost(self, world: int, kind: str = "matmul") -> float:
        """The compute stream's extra seconds per second of an NCCL collective running beside it (its kernels take SMs
        and memory bandwidth), as calibrate measured it over ``world`` GPUs (else the nearest world it measured);
        0 where it did not (a data-sheet table, or one calibrated before this was measured: it says uncalibrated)."""
        if world <= 1 or not self.nccl_overlap:
            return 0.0
        near = min(self.nccl_overlap, key=lambda w: abs(int(w) - world))
        return float(self.nccl_overlap[near].get(kind, 0.0))

    def pcie_seconds(self, nbytes: float, direction: str = "h2d") -> float:
        return nbytes / (self.pcie_gbps.get(direction, 20.0) * 1e9)

    def host_seconds(self, kind: str) -> float:
        return self.host_us.get(kind, 0.0) * 1e-6 * self.host_scale()

    def host_scale(self) -> float:
        """The factor on every host cost: a table that names a reference host (env ``host_reference_ms``: the fixed
        Python loop of memlens.measure.host_phases.host_speed on the typical host of its GPU's machines) prices the
        host at that speed, not at the speed the host had while calibrate measured (env ``host_speed_ms``: min,
        median, max; the same host drifts 2x within minutes: bench/results/host_probe.md). Else 1."""
        hit = self._memo.get("host_scale")
        if hit is None:
            env = self.env or {}
            ref, cal = env.get("host_reference_ms"), env.get("host_speed_ms")
            ok = isinstance(ref, (int, float)) and ref > 0 and isinstance(cal, list) and len(cal) == 3 and cal[1] > 0
            hit = self._memo["host_scale"] = ref / cal[1] if ok else 1.0
        return hit

    def unmeasured_ops(self) -> list[str]:
        """The op rates calibrate measures now that this calibrated table lacks (none for a data-sheet table: it
        measured nothing, and says uncalibrated)."""
        if not self.calibrated:
            return []
        missing = set(CALIBRATED_OPS - set(self.op_ratio))
        for op in SOFTMAX_OPS | LAYER_NORM_OPS:   # by row width (ops_kinds): a table without them has the op's one rate
            if not any(k.startswith(op + "/w") for k in self.op_ratio):
                missing.add(op + "/w*")
        return sorted(missing)

    def matmul_loop_timed(self) -> bool:
        """A calibrated table whose GEMM grids were timed before calibrate graphed mid-size GEMMs (no ``env[MATMUL_TIMER]``,
        none borrowed from a graph-timed table): it prices GEMMs of ~10-50 us slow."""
        env = self.env or {}
        return self.calibrated and MATMUL_TIMER not in env and not (env.get(BORROWED) or {}).get("gemms_under_flops")

    def borrowed(self) -> dict | None:
        """What this table took from another GPU's (:func:`borrow_rates`): the source's name, the op rates, the GEMMs
        under how many FLOPs; None where it took nothing."""
        b = (self.env or {}).get(BORROWED)
        return b if isinstance(b, dict) and b else None

    def host_range(self) -> tuple[float, float] | None:
        """(fast, slow) factors on the priced host costs: the spread of the host's speed beside steps measured on this
        table's machines (env ``host_range_ms``: the quartiles, bench/host_range.py) over the reference host the
        table prices at (``host_reference_ms``). None where the table names no such spread (a table calibrate wrote
        prices its own host, whose spread it did not see)."""
        env = self.env or {}
        rng, ref = env.get("host_range_ms"), env.get("host_reference_ms")
        if not (isinstance(rng, list) and len(rng) == 2 and isinstance(ref, (int, float)) and ref > 0 and 0 < rng[0] <= rng[1]):
            return None
        return rng[0] / ref, rng[1] / ref

    # ------------------------------------------------------------ files
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("note")
        d.pop("_memo")
        return _strip_logs(d)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TimingTable":
        if d.get("format") != FORMAT:
            raise SpecError(f"timing table format {d.get('format')!r} is not {FORMAT}", hint="rerun memlens calibrate")
        known = {f for f in cls.__dataclass_fields__}
        t = cls(**{k: v for k, v in d.items() if k in known and k not in ("note", "_memo")})
        _add_logs(t)
        _embedding_rows(t)
        return t

    def write(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return p


def read_table(path: str | Path) -> TimingTable:
    p = Path(path)
    try:
        d = json.loads(p.read_text())
    except FileNotFoundError:
        raise SpecError(f"timing table {str(p)!r} does not exist", hint="memlens calibrate --out FILE writes one on a GPU") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpecError(f"timing table {str(p)!r} is not JSON ({e})", hint="memlens calibrate --out FILE writes one") from None
    if not isinstance(d, dict) or "gpu" not in d:
        raise SpecError(f"timing table {str(p)!r} has no 'gpu' field", hint="memlens calibrate --out FILE writes one")
    return TimingTable.from_dict(d)


_CACHE: dict = {}


def table_for(gpu: str | None, path: str | Path | None = None) -> TimingTable:
    """The table to price ``gpu``'s step with, its ``note`` saying what it is: ``path`` (else $MEMLENS_TIMING_TABLE)
    if given, else the shipped file for that GPU, else the data sheet's. A table of another GPU is used only when
    named, and the note says so."""
    name = gpu_facts(gpu).name
    path = path or os.environ.get(ENV_TABLE) or None
    key = (name, str(path) if path else None, _mtime(path))
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    if path:
        t = read_table(path)
        what = "calibrated" if t.calibrated else "uncalibrated"
        t.note = f"{what} table {Path(path).name} ({t.device_name or t.gpu})"
        if t.gpu != name:
            t.note += f", measured on a {t.gpu} and used for the {name} as asked (--timing-table)"
    else:
        shipped = DATA_DIR / f"{name}_timing.json"
        t = read_table(shipped) if shipped.exists() else datasheet_table(name)
        t.note = (f"calibrated on a {t.device_name or name}" if t.calibrated
                  else f"uncalibrated: {name} data-sheet rates (run memlens calibrate on the GPU for measured ones)")
    missing = t.unmeasured_ops()
    if missing:
        t.note += f"; {len(missing)} op rate{'s' if len(missing) > 1 else ''} not measured there"
    b = t.borrowed()
    if b:
        took = [f"{len(b['ops'])} op rate{'s' if len(b['ops']) > 1 else ''}"] if b.get("ops") else []
        took += [f"GEMMs under {b['gemms_under_flops']:g} FLOPs"] if b.get("gemms_under_flops") else []
        t.note += f"; {' and '.join(took)} from the {b['from']}'s table"
    if t.matmul_loop_timed():
        t.note += "; mid-size GEMMs timed at the host's pace there"
    _CACHE[key] = t
    return t


def _mtime(path) -> float | None:
    try:
        return os.path.getmtime(path) if path else None
    except OSError:
        return None


# ---------------------------------------------------------------- data-sheet tables
def _sat(x: float, half: float) -> float:
    return x / (x + half)


def datasheet_table(gpu: str) -> TimingTable:
    """A table from the data sheet of ``gpu`` (memlens.core.gpus) and the typical efficiencies above: a GEMM's rate
    saturates with each dimension (x / (x + x0): M at 128 rows, N and K at 256; fp32 at the SIMT peak), copies with
    size (half the asymptote at 1 MiB), attention with sequence length (half at 512 tokens)."""
    f = gpu_facts(gpu)
    peaks = {"bfloat16": f.peak_tflops_half if f.bf16 else f.peak_tflops_half / 8, "float16": f.peak_tflops_half,
             "tf32": f.peak_tflops_fp32, "float32": FP32_SIMT_TFLOPS.get(f.name, f.peak_tflops_fp32 / 4)}
    matmul = {}
    for dt, peak in peaks.items():
        eff = EFF_SIMT if dt == "float32" else EFF_MATMUL
        top = peak * eff / (_sat(GRID_M[-1], 128) * _sat(GRID_NK[-2], 256) ** 2)
        matmul[dt] = {"m": list(GRID_M), "n": list(GRID_NK), "k": list(GRID_NK),
                      "tflops": [[[round(min(peak * eff, top * _sat(m, 128) * _sat(n, 256) * _sat(k, 256)), 3)
                                   for k in GRID_NK] for n in GRID_NK] for m in GRID_M]}
    attention = {dt: {"seq": list(GRID_SEQ),
                      "fwd_tflops": [round(peaks[dt] * EFF_ATTN_FWD * _sat(s, 512), 3) for s in GRID_SEQ],
                      "bwd_tflops": [round(peaks[dt] * EFF_ATTN_BWD * _sat(s, 512), 3) for s in GRID_SEQ]}
                 for dt in ("bfloat16", "float16")}
    bw = {"bytes": list(GRID_BYTES), "gbps": [round(f.dram_gbps * EFF_DRAM * _sat(b, 2**20), 2) for b in GRID_BYTES]}
    t = TimingTable(gpu=f.name, device_name=f.label, calibrated=False,
                    source=f"data sheet ({f.name}: {f.peak_tflops_half:g} dense fp16/bf16 TFLOP/s, {f.dram_gbps:g} GB/s DRAM, "
                           f"{f.pcie_gbps:g} GB/s PCIe) at typical efficiencies (memlens.estimator.timing.tables)",
                    matmul=matmul, attention=attention, bandwidth=bw, min_kernel_us=3.0,
                    # eager PyTorch on a typical server CPU: ~10 us per op under Python modules, ~5 us per op the
                    # autograd engine runs, ~15 us per foreach op, ~2 us for a view (assumptions until measured)
                    host_us={"forward": 10.0, "backward": 5.0, "optimizer": 15.0, "view": 2.0},
                    pcie_gbps={"h2d": round(f.pcie_bytes_per_s / 1e9, 1), "d2h": round(f.pcie_bytes_per_s / 1e9, 1)},
                    nccl={str(w): _datasheet_nccl(f.name, w) for w in (2, 4, 8)})
    _add_logs(t)
    return t


def _datasheet_nccl(gpu: str, world: int) -> dict:
    f = gpu_facts(gpu)
    link = NVLINK_GBPS.get(f.name, f.pcie_gbps) * EFF_LINK
    row = {"bytes": list(GRID_NCCL), "busbw_gbps": [round(link * _sat(b, 4 * 2**20), 2) for b in GRID_NCCL], "latency_us": 15.0}
    out = {"all_reduce": row, "all_gather": dict(row)}
    for r in out.values():
        r["log_busbw"] = [math.log(max(v, 1e-6)) for v in r["busbw_gbps"]]
    return out


# ---------------------------------------------------------------- a table of the same chip
def borrow_rates(t: TimingTable, src: TimingTable, gemms_under_flops: float, why: str) -> list[str]:
    """Fill what calibrated table ``t`` lacks from ``src``, a table of a GPU of the same chip (an H100 from an H200:
    the same GH100's SMs, clocks and kernels, HBM3 beside HBM3e) whose rates were measured as calibrate measures them
    now; ``t.env[BORROWED]`` names what was taken (the note says so). Returns the ops (as ``unmeasured_ops`` names them) taken.

    - every op rate ``t`` does not have (``unmeasured_ops``: a rate is a ratio to the table's own copy bandwidth, so
      it carries over where the kernel is the same);
    - the GEMM grids' points under ``gemms_under_flops`` (``src`` timed them from a CUDA graph; ``t`` from a Python
      loop, at its host's pace), on ``src``'s axes: ``src``'s time, or the bytes' time at ``t``'s bandwidth where
      that is longer (a roofline: a GEMM bound by memory runs at its GPU's bandwidth); larger GEMMs keep ``t``'s."""
    lacked = t.unmeasured_ops()
    for k, v in src.op_ratio.items():
        t.op_ratio.setdefault(k, v)
    ops = sorted(set(lacked) - set(t.unmeasured_ops()))
    for grids, theirs in ((t.matmul, src.matmul), (t.matmul_unaligned, src.matmul_unaligned),
                          (t.matmul_unaligned_out, src.matmul_unaligned_out)):
        for dtype, g in theirs.items():
            if dtype in grids:
                grids[dtype] = _borrowed_grid(t, grids[dtype], g, dtype, gemms_under_flops)
    t.env[BORROWED] = {"from": src.device_name or src.gpu, "ops": ops, "gemms_under_flops": gemms_under_flops,
                       "why": why}
    t._memo.clear()
    _add_logs(t)
    return ops


def _borrowed_grid(t: TimingTable, mine: dict, theirs: dict, dtype: str, under: float) -> dict:
    el = 4 if dtype in ("float32", "tf32") else 2
    rates = []
    for i, m in enumerate(theirs["m"]):
        plane = []
        for j, n in enumerate(theirs["n"]):
            row = []
            for l, k in enumerate(theirs["k"]):
                flops, rate = 2 * m * n * k, theirs["tflops"][i][j][l]
                have = m in mine["m"] and n in mine["n"] and k in mine["k"]
                if (flops >= under and have) or not rate:   # a large GEMM, or one the source did not measure: its own
                    row.append(mine["tflops"][mine["m"].index(m)][mine["n"].index(n)][mine["k"].index(k)] if have else
                               float(f"{math.exp(_trilinear(mine['m'], mine['n'], mine['k'], mine['log_tflops'], m, n, k)):.4g}"))
                    continue
                nbytes = (m * k + k * n + m * n) * el
                sec = max(flops / (rate * 1e12), nbytes / (t.bandwidth_gbps(nbytes) * 1e9))
                row.append(float(f"{flops / sec / 1e12:.4g}"))
            plane.append(row)
        rates.append(plane)
    return {"m": list(theirs["m"]), "n": list(theirs["n"]), "k": list(theirs["k"]), "tflops": rates}


# ---------------------------------------------------------------- logs and interpolation
def _add_logs(t: TimingTable) -> None:
    """Cache the logs of every rate (what the interpolation works on); :func:`_strip_logs` drops them on write."""
    for g in t.matmul.values():
        g["log_tflops"] = [[[math.log(max(v, 1e-6)) for v in row] for row in plane] for plane in g["tflops"]]
    for g in [*t.matmul_unaligned.values(), *t.matmul_unaligned_out.values()]:
        g["log_tflops"] = [[[math.log(max(v, 1e-6)) for v in row] for row in plane] for plane in g["tflops"]]
    for g in t.attention.values():
        for row in [g, *(g.get("variants") or {}).values()]:
            row["log_fwd"] = [math.log(max(v, 1e-6)) for v in row["fwd_tflops"]]
            row["log_bwd"] = [math.log(max(v, 1e-6)) for v in row["bwd_tflops"]]
    if t.bandwidth:
        t.bandwidth["log_gbps"] = [math.log(max(v, 1e-6)) for v in t.bandwidth["gbps"]]
    for rows in t.nccl.values():
        for r in rows.values():
            r["log_busbw"] = [math.log(max(v, 1e-6)) for v in r["busbw_gbps"]]


def _embedding_rows(t: TimingTable) -> None:
    """A table calibrated before embedding_dense_backward was split (its ratio over all the op's bytes at
    ``EMBEDDING_CAL``: the [V, H] gradient's zero-fill and the rows' kernels together): the rows' own ratio, the
    calibration case's time less its fill priced at the table's ``fill_`` rate."""
    from .ops import EMBEDDING_CAL, EMBEDDING_ROWS

    whole = t.op_ratio.get("embedding_dense_backward")
    if EMBEDDING_ROWS in t.op_ratio or not whole or not t.bandwidth:
        return
    n, h, v = EMBEDDING_CAL
    rows, fill = n * h * 2 + n * 8, v * h * 2          # bf16 gradient rows and int64 indices; the bf16 [V, H] output
    left = t.op_seconds("embedding_dense_backward", rows + fill) - t.op_seconds("fill_", fill)
    if left > 0:
        t.op_ratio[EMBEDDING_ROWS] = rows / (t.bandwidth_gbps(rows) * 1e9 * left)


def _strip_logs(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _strip_logs(v) for k, v in d.items() if not k.startswith("log_")}
    if isinstance(d, list):
        return [_strip_logs(v) for v in d]
    return d


def _bracket(grid: list, x: float) -> tuple[int, int, float]:
    """Indices i, j and weight w of log2(x) between grid[i] and grid[j] (clamped at the ends)."""
    if x <= grid[0]:
        return 0, 0, 0.0
    if x >= grid[-1]:
        n = len(grid) - 1
        return n, n, 0.0
    j = bisect_right(grid, x)
    i = j - 1
    lo, hi = math.log2(grid[i]), math.log2(grid[j])
    return i, j, (math.log2(x) - lo) / (hi - lo)


def _linear(grid: list, vals: list, x: float) -> float:
    i, j, w = _bracket(grid, x)
    return vals[i] * (1 - w) + vals[j] * w


def _trilinear(gm: list, gn: list, gk: list, vals: list, m: float, n: float, k: float) -> float:
    im, jm, wm = _bracket(gm, m)
    in_, jn, wn = _bracket(gn, n)
    ik, jk, wk = _bracket(gk, k)
    out = 0.0
    for a, wa in ((im, 1 - wm), (jm, wm)):
        for b, wb in ((in_, 1 - wn), (jn, wn)):
            for c, wc in ((ik, 1 - wk), (jk, wk)):
                if wa and wb and wc:
                    out += wa * wb * wc * vals[a][b][c]
    return out


def known_gpus() -> list[str]:
    return sorted(GPUS)
