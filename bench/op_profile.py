"""Where a real step's GPU time goes, op by op, beside what memlens' time model prices for each op (issue 36).

On the GPU (``profiled_step``, called by bench/gpu_step_time.py ``--profile`` after a case's timed steps): one more
step under torch.profiler; every CUDA kernel is attributed to the aten op that launched it (the innermost CPU op
of its correlation id) and to a phase (backward when an ancestor is an autograd-engine node, else the step loop's
phase region around it), then summed per (phase, op name): kernel seconds, kernels, launching ops. Per phase also the kernel seconds and the
aten ops dispatched (all, and those called from outside another aten op): the phase's duration measured without
the profiler (CUDA events) minus its kernel seconds is where the GPU waited on the host. Matmuls and every other op
are kept by input shapes too (``matmul_shapes``, ``memory_shapes``).

On the CPU (``predicted_ops``): the same spec estimated with the op hook noting each op's name and largest input,
priced with the same table, summed the same way. ``compare`` lines both up per op; ``compare_shapes`` (``--shapes``)
per op and largest input shape for memory-bound ops, the largest differences first (how the upcast's, softmax
backward's and RoPE's own rates were found: bench/results/bandwidth_probe.md).

    python bench/op_profile.py out/gpu_step_time.jsonl --table memlens/data/gpus/h100_timing.json [--only NAME]
    python bench/op_profile.py FILE --table T --predict --shapes --only NAME
    python bench/op_profile.py FILE --table T --matmuls      # each aligned mm's kernel time beside the table's price
"""
from __future__ import annotations

import argparse
import ast
import json
import math
import os
import sys
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

ENGINE = "autograd::engine::evaluate_function"
PHASE_TAG = "memlens/"      # memlens.measure.phase_time.PhaseRegions' region names
# fused attention: the kernels attach to the innermost op (the flash/efficient call under SDPA's wrapper)
ATTN_NAMES = {"aten::_cudnn_attention_forward": "attention_fwd", "aten::_cudnn_attention_backward": "attention_bwd",
              "aten::_flash_attention_forward": "attention_fwd", "aten::_efficient_attention_forward": "attention_fwd",
              "aten::_scaled_dot_product_flash_attention": "attention_fwd",
              "aten::_scaled_dot_product_efficient_attention": "attention_fwd",
              "aten::_scaled_dot_product_cudnn_attention": "attention_fwd",
              "aten::_flash_attention_backward": "attention_bwd", "aten::_efficient_attention_backward": "attention_bwd",
              "aten::_scaled_dot_product_flash_attention_backward": "attention_bwd",
              "aten::_scaled_dot_product_efficient_attention_backward": "attention_bwd",
              "aten::_scaled_dot_product_cudnn_attention_backward": "attention_bwd"}


def op_key(name: str) -> str:
    return ATTN_NAMES.get(name, name)


# ---------------------------------------------------------------- GPU side
def profiled_step(step, torch, dev) -> dict:
    """One step of ``step`` under torch.profiler, summed per (phase, op) and per phase (module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    from memlens.measure.phase_time import PhaseRegions

    regions = PhaseRegions(torch)
    torch.cuda.synchronize(dev)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        step.run(regions.on_phase)
        regions.close()
        torch.cuda.synchronize(dev)
    return summarize(prof.events())


def _phase_of(ev) -> str:
    p = ev
    while p is not None:
        if p.name.startswith(ENGINE):
            return "backward"
        if p.name.startswith(PHASE_TAG):
            ph = p.name[len(PHASE_TAG):]
            return "optimizer" if ph == "clip" else ph
        p = p.cpu_parent
    return "other"


def summarize(events) -> dict:
    ops: dict = defaultdict(lambda: [0.0, 0, 0])        # (phase, op) -> [kernel s, kernels, launching ops]
    cpu_ops: dict = defaultdict(int)                      # phase -> aten ops dispatched
    kernel_s: dict = defaultdict(float)                   # phase -> kernel seconds
    top_ops: dict = defaultdict(int)                      # phase -> aten ops called from outside any aten op
    shapes: dict = defaultdict(lambda: [0.0, 0])          # (phase, op, input shapes) -> [kernel s, calls]: matmuls
    mem_shapes: dict = defaultdict(lambda: [0.0, 0])      # the same for every other op (memory-bound ones)
    comm: dict = defaultdict(lambda: [0.0, 0])            # phase -> [NCCL kernel s, kernels] (their own stream)
    host: dict = defaultdict(float)                       # phase -> the host's wall seconds in the phase's region
    for ev in events:
        if ev.device_type.name == "CPU" and ev.name.startswith(PHASE_TAG):
            ph = ev.name[len(PHASE_TAG):]
            host["optimizer" if ph == "clip" else ph] += ev.time_range.elapsed_us() / 1e6
        if ev.device_type.name == "CPU" and not ev.name.startswith("aten::"):
            nccl = [k for k in ev.kernels if k.duration > 0 and "nccl" in k.name.lower()]
            if nccl:   # FSDP2's / DDP's collectives: is a phase's idle GPU time the host's or a wait on NCCL?
                c = comm[_phase_of(ev)]
                c[0] += sum(k.duration for k in nccl) / 1e6
                c[1] += len(nccl)
        if ev.device_type.name != "CPU" or not ev.name.startswith("aten::"):
            continue
        ph = _phase_of(ev)
        cpu_ops[ph] += 1
        if ev.cpu_parent is None or not ev.cpu_parent.name.startswith("aten::"):
            top_ops[ph] += 1
        ks = [k for k in ev.kernels if k.duration > 0]
        if not ks:
            continue
        key = op_key(ev.name)
        sec = sum(k.duration for k in ks) / 1e6
        kernel_s[ph] += sec
        row = ops[(ph, key)]
        row[0] += sec
        row[1] += len(ks)
        row[2] += 1
        if key in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::convolution", "aten::cudnn_convolution"):
            s = shapes[(ph, key, str(ev.input_shapes)[:200])]
        else:
            s = mem_shapes[(ph, key, str(ev.input_shapes)[:200])]
        s[0] += sec
        s[1] += 1
    return {"ops": [[ph, op, round(v[0], 7), v[1], v[2]] for (ph, op), v in sorted(ops.items(), key=lambda x: -x[1][0])],
            "cpu_ops": dict(cpu_ops), "top_ops": dict(top_ops), "kernel_s": dict(kernel_s),
            "nccl": {ph: [round(v[0], 7), v[1]] for ph, v in comm.items()}, "host_s": {ph: round(v, 6) for ph, v in host.items()},
            "matmul_shapes": [[ph, op, sh, round(v[0], 7), v[1]] for (ph, op, sh), v in
                              sorted(shapes.items(), key=lambda x: -x[1][0])[:60]],
            "memory_shapes": [[ph, op, sh, round(v[0], 7), v[1]] for (ph, op, sh), v in
                              sorted(mem_shapes.items(), key=lambda x: -x[1][0])[:120]]}


# ---------------------------------------------------------------- CPU side
def predicted_ops(fields: dict, table: str | None = None) -> dict:
    """memlens' priced rows of ``fields`` (one micro-batch, the full depth) summed per (phase, op name): {(phase, op):
    [GPU s, host s, ops]}, the predicted step-time parts, and the rows' kinds counted per phase."""
    if table:
        os.environ["MEMLENS_TIMING_TABLE"] = os.path.abspath(table)
    from memlens.core.spec import TrainingSpec
    from memlens.estimator import estimate
    from memlens.estimator.timing import record
    from memlens.estimator.timing.tables import table_for

    recs: list = []
    orig_attach, orig_op, orig_att, orig_add = record.attach, record.Recorder.op, record.Recorder.attention, record.Recorder.add

    def attach(tracker, rules, spec):
        rec = orig_attach(tracker, rules, spec)
        rec.names, rec.shapes, rec.nm, rec.sh = [], [], None, ()
        recs.append(rec)
        return rec

    def op(self, func, args, kwargs, out):
        self.nm = "aten::" + func._schema.name.split("::")[-1]
        self.sh = _largest(args)
        try:
            orig_op(self, func, args, kwargs, out)
        finally:
            self.nm = None

    def attention(self, backend, q, k, v, causal, out, dropout=False):
        self.nm = "attention_fwd"
        try:
            orig_att(self, backend, q, k, v, causal, out, dropout)
        finally:
            self.nm = None

    def add(self, f):
        orig_add(self, f)
        if hasattr(self, "names"):
            self.names.append(self.nm or ("attention_bwd" if f.kind == "attn_bwd" else f.kind))
            self.shapes.append(self.sh if self.nm else ())

    record.Recorder.add = add
    record.attach, record.Recorder.op, record.Recorder.attention = attach, op, attention
    try:
        spec = TrainingSpec(**{k: v for k, v in fields.items() if k not in ("base", "skip")})
        r = estimate(spec)
    finally:
        record.attach, record.Recorder.op, record.Recorder.attention = orig_attach, orig_op, orig_att
        record.Recorder.add = orig_add
    tab = table_for(spec.gpu)
    want = (spec.batch_size if not spec.dp else min(spec.physical_batch_size or spec.batch_size, spec.batch_size), spec.seq_len)
    rec = next((x for x in reversed(recs) if x.trace.rows and x.trace.size == want and x.trace.layers), None) or next(
        (x for x in reversed(recs) if x.trace.rows and x.trace.size == want), None) or next(
        (x for x in reversed(recs) if x.trace.rows), None)
    out: dict = defaultdict(lambda: [0.0, 0.0, 0])
    shaped: dict = defaultdict(lambda: [0.0, 0])
    kinds: dict = defaultdict(lambda: defaultdict(int))
    if rec is None:
        return {"ops": {}, "kinds": {}, "parts": (r.data.get("step_time") or {}).get("parts"), "size": None, "shapes": {}}
    priced, i = [], 0
    for p in record.price(rec.trace, tab):     # FSDP2's forward all-gathers are rows of their own (no aten op)
        if p[5] == "gather":
            priced.append(p + (("nccl:all_gather", ()),))
            continue
        priced.append(p + ((rec.names[i], rec.shapes[i]),))
        i += 1
    for b, _mod, g, h, _fl, kind, (name, shape) in record.expanded(priced, rec.trace):
        row = out[(b, name)]
        row[0] += g
        row[1] += h
        row[2] += 1
        kinds[b][kind] += 1
        if kind == "memory":
            sh = shaped[("backward" if b == "recompute" else b, _KERNEL_OP.get(name, name), shape)]
            sh[0] += g
            sh[1] += 1
    return {"ops": dict(out), "kinds": {k: dict(v) for k, v in kinds.items()},
            "parts": (r.data.get("step_time") or {}).get("parts"), "size": rec.trace.size, "shapes": dict(shaped)}


# the aten op whose kernels a profile attributes a memory-bound op's time to (the innermost op launching them)
_KERNEL_OP = {"aten::_to_copy": "aten::copy_", "aten::clone": "aten::copy_", "aten::contiguous": "aten::copy_"}


def _largest(args) -> tuple:
    """The shape of the largest tensor among an op's arguments (lists of tensors included)."""
    best: tuple = ()
    for a in args:
        for t in (a if isinstance(a, (list, tuple)) else [a]):
            shape = getattr(t, "shape", None)
            if shape is not None and math.prod(shape) > math.prod(best or (0,)):
                best = tuple(int(d) for d in shape)
    return best


def compare_shapes(rec: dict, pred: dict, top: int = 40) -> str:
    """Memory-bound ops by (phase, kernel-launching op, largest input shape): measured kernel seconds beside predicted,
    the largest differences first (one micro-batch; ops the profile attributes elsewhere show as unmatched)."""
    k = rec["spec"].get("grad_accum", 1)
    meas: dict = defaultdict(lambda: [0.0, 0])
    for ph, op, sh, s, n in rec["profile"].get("memory_shapes", []):
        try:
            shapes = [tuple(x) for x in ast.literal_eval(sh) if isinstance(x, list) and x and all(isinstance(d, int) for d in x)]
        except (ValueError, SyntaxError):
            shapes = []
        m = meas[(ph, op, max(shapes, key=math.prod) if shapes else ())]
        m[0] += s
        m[1] += n
    pr = {q: (g * k, n * k) for q, (g, n) in pred["shapes"].items()}
    keys = sorted(set(meas) | set(pr), key=lambda q: -abs(meas.get(q, (0, 0))[0] - pr.get(q, (0, 0))[0]))
    lines = [f"{'phase':9s} {'op':26s} {'largest input':28s} {'meas ms':>8s} {'n':>5s} {'pred ms':>8s} {'n':>5s}"]
    for q in keys[:top]:
        m, p = meas.get(q, (0.0, 0)), pr.get(q, (0.0, 0))
        lines.append(f"{q[0]:9s} {q[1][:26]:26s} {str(list(q[2]))[:28]:28s} {m[0] * 1e3:8.3f} {m[1]:5d} {p[0] * 1e3:8.3f} {p[1]:5d}")
    return "\n".join(lines)


def compare(rec: dict, pred: dict, top: int = 30) -> str:
    """Measured kernel seconds per (phase, op) beside the predicted GPU seconds of the same op (one micro-batch)."""
    prof = rec["profile"]
    k = rec["spec"].get("grad_accum", 1)
    meas: dict = {}
    for ph, op, s, _nk, nops in prof["ops"]:
        m = meas.setdefault((ph, op_key(op)), [0.0, 0])
        m[0] += s
        m[1] += nops
    pr = {}
    for (ph, op), (g, h, n) in pred["ops"].items():
        ph = "backward" if ph == "recompute" else ph
        x = pr.setdefault((ph, op), [0.0, 0.0, 0])
        x[0] += g * k
        x[1] += h * k
        x[2] += n * k
    keys = sorted(set(meas) | set(pr), key=lambda q: -max(meas.get(q, (0, 0))[0], pr.get(q, (0, 0, 0))[0]))
    lines = [f"{'phase':9s} {'op':42s} {'meas ms':>8s} {'n':>5s} {'pred ms':>8s} {'n':>5s}"]
    for q in keys[:top]:
        m, p = meas.get(q, (0.0, 0)), pr.get(q, (0.0, 0.0, 0))
        lines.append(f"{q[0]:9s} {q[1]:42s} {m[0] * 1e3:8.2f} {m[1]:5d} {p[0] * 1e3:8.2f} {p[2]:5d}")
    return "\n".join(lines)


def matmuls_vs_table(rec: dict, table: str | None = None) -> list[tuple]:
    """Each profiled ``aten::mm`` shape (A [M, K] @ B [K, N]) whose dimensions are all 16-byte aligned: (phase, M, K,
    N, calls, measured us a call, the table's price for it) - its FLOPs at the grid's rate, never under its bytes at the
    copy's bandwidth nor the kernel floor, as the time model prices a GEMM (memlens.estimator.timing.tables)."""
    from memlens.estimator.timing.tables import table_for

    tab = table_for(rec["spec"].get("gpu"), table)
    fp32 = rec["spec"].get("precision") == "fp32"
    dtype, el = ("float32", 4) if fp32 else ("bfloat16", 2)
    out = []
    for ph, op, sh, s, n in rec["profile"].get("matmul_shapes", []):
        shapes = ast.literal_eval(sh)
        if op != "aten::mm" or len(shapes) < 2 or len(shapes[0]) != 2 or len(shapes[1]) != 2:
            continue
        (m, k), (_, nn) = shapes[0], shapes[1]
        if any(d * el % 16 for d in (m, k, nn)):      # an unaligned leading dimension: the unaligned grids, not read here
            continue
        flops, nbytes = 2 * m * nn * k, el * (m * k + k * nn + m * nn)
        price = tab.kernel_seconds(flops, tab.matmul_tflops(dtype, m, nn, k), nbytes)
        out.append((ph, m, k, nn, n, s / n * 1e6, price * 1e6))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsonl")
    ap.add_argument("--table")
    ap.add_argument("--only")
    ap.add_argument("--predict", action="store_true", help="estimate each case here and show the predicted ops beside")
    ap.add_argument("--matmuls", action="store_true", help="each profiled mm shape's measured TFLOP/s beside the "
                    "table's rate for it")
    ap.add_argument("--shapes", action="store_true", help="with --predict: memory-bound ops by shape (records with "
                    "memory_shapes), the largest differences first")
    a = ap.parse_args(argv)
    for line in open(a.jsonl):
        rec = json.loads(line)
        if a.only and rec["name"] not in a.only.split(","):
            continue
        prof = rec.get("profile")
        if not prof:
            continue
        print(f"## {rec['name']}: measured {rec.get('measured_seconds')} s, phases {rec.get('measured_phases')}")
        for ph, ks in prof["kernel_s"].items():
            extra = "".join([f", NCCL kernels {prof['nccl'][ph][0] * 1e3:.1f} ms" if ph in prof.get("nccl", {}) else "",
                             f", host {prof['host_s'][ph] * 1e3:.1f} ms" if ph in prof.get("host_s", {}) else ""])
            print(f"  {ph}: kernels {ks * 1e3:.1f} ms, aten ops {prof['cpu_ops'].get(ph)} ({prof['top_ops'].get(ph)} top-level){extra}")
        if a.matmuls:
            for ph, m, k, n, calls, meas, price in matmuls_vs_table(rec, a.table):
                print(f"  {ph:9s} {m:6d} x {k:6d} x {n:6d}  {calls:4d} calls  measured {meas:8.1f} us  priced {price:8.1f}"
                      f"  ({price / meas:.2f})")
        if a.predict:
            pred = predicted_ops(rec["spec"], a.table)
            print("  predicted kinds per phase:", pred["kinds"], "at size", pred["size"])
            print(compare(rec, pred))
            if a.shapes:
                print(compare_shapes(rec, pred))
        else:
            for ph, op, s, nk, nops in prof["ops"][:25]:
                print(f"  {ph:9s} {op:45s} {s * 1e3:8.2f} ms  {nk:5d} kernels {nops:5d} ops")
    return 0


if __name__ == "__main__":
    sys.exit(main())
