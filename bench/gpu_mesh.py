"""HSDP, TP x FSDP2, CP x FSDP2 and PP x FSDP2 per rank on 4 GPUs (issue 37): measured peaks vs memlens' per-rank estimate.

Run on a 4-GPU machine from the repo root (6 mesh cases: about 7 minutes on 4 x H100; the 4 pipeline cases apart):

    python bench/gpu_mesh.py            # results under $OUT (default ./out): gpu_mesh.jsonl, a table printed last
    python bench/gpu_mesh.py --dry-run  # CPU only: every case's estimate on a tiny Llama (no GPU, no torchrun)
    python bench/gpu_mesh.py hsdp       # only the cases whose name contains "hsdp"
    python bench/gpu_mesh.py cp2        # only context parallel: CP 2 x FSDP2 2 (torch's ring attention)
    python bench/gpu_mesh.py pp         # only pipeline parallel (pp2: PP 2 x FSDP2 2 with 1F1B, GPipe, interleaved; pp4)
    python bench/gpu_mesh.py profile    # only `memlens profile --world-size 4` of each mesh (about 3 minutes)
    python bench/gpu_mesh.py --reestimate A/gpu_mesh.jsonl B/gpu_mesh.jsonl --out DIR   # no GPU: estimated again
    python bench/gpu_mesh.py 2nodes     # only `memlens profile --nnodes 2 --nproc-per-node 2` (two agents, GPUs 0-1 and 2-3)

Each case runs in its own torchrun job through bench/gpu_runner.py (cases already in the JSONL are skipped, --fresh
starts over, --list names them; bench/gpu_distributed.py's rank code: memlens.step.prepare builds the very
wrapper the estimate simulates - FSDP2 fully_shard on a 2 x 2 replicate x shard mesh, or parallelize_module with
torchtitan's Llama TP plan then fully_shard on the data-parallel sub-mesh, or fully_shard over dp_shard x cp with each
rank's L / 2 tokens and torch's context_parallel entered for the process (ring attention) - resets the peak counters after building
and runs 3 steps), so an OOM or a crash loses one case. The pipeline cases run bench/pipeline_rank.py's rank code instead: the
stages memlens' PPWrapper builds, run by torch's own PipelineStage and schedule (peaks over steps 2-3). Every rank's max_memory_allocated / max_memory_reserved is
compared with memlens' estimate of the same rank (estimate_ranks on fake CPU tensors, in this process after each
case's GPU run; the rank group that stands for it). One JSON line per case (its ranks' records and the estimate) is
appended to $OUT/gpu_mesh.jsonl as it comes (--dry-run: $OUT/gpu_mesh_dry.jsonl), with each rank's NCCL memory (NVML
growth the caching allocator does not explain: several communicators per rank on a 2D mesh). Then `memlens profile --world-size 4 --compare-estimate` runs once per mesh (the CLI's own torchrun launch),
its output kept in $OUT/profile-*.txt.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.gpu_distributed import CHILD_ENV  # noqa: E402
from bench.gpu_runner import as_cases, gib, last_records, list_or_run, read_jsonl, runner_args, select  # noqa: E402

WORLD = 4
JSONL = "gpu_mesh.jsonl"
CASE_TIMEOUT = 300
LLAMA_1B = dict(model="llama-3.2-1b", batch_size=4, seq_len=1024, precision="amp-bf16")
TINY = dict(model="tests/fixtures/tiny-llama", batch_size=2, seq_len=64, precision="amp-bf16")


def cases(base: dict) -> list[tuple[str, dict]]:
    """4-GPU meshes on a Llama-class model: FSDP2 over 4 (the baseline, measured exact before), HSDP 2 x 2,
    TP 2 x FSDP2 2 (with and without checkpointing), CP 2 x FSDP2 2 (each rank half of a 2x longer sequence; with and
    without checkpointing)."""
    w = {"world_size": WORLD}
    return [
        ("fsdp4-llama1b-ampbf16-b4-L1024", dict(base, sharding="fsdp", **w)),
        ("hsdp2x2-llama1b-ampbf16-b4-L1024", dict(base, sharding="hsdp", shard_size=2, **w)),
        ("tp2xfsdp2-llama1b-ampbf16-b4-L1024", dict(base, sharding="fsdp", tp=2, **w)),
        ("tp2xfsdp2-llama1b-ampbf16-ckpt-b4-L2048", dict(base, sharding="fsdp", tp=2, grad_checkpointing=True,
                                                         seq_len=2 * base["seq_len"], **w)),
        ("cp2xfsdp2-llama1b-ampbf16-b4-L2048", dict(base, sharding="fsdp", cp=2, seq_len=2 * base["seq_len"], **w)),
        ("cp2xfsdp2-llama1b-ampbf16-ckpt-b4-L4096", dict(base, sharding="fsdp", cp=2, grad_checkpointing=True,
                                                         seq_len=4 * base["seq_len"], **w)),
    ] + pp_cases(base)


def pp_cases(base: dict) -> list[tuple[str, dict]]:
    """PP x FSDP2 on 4 GPUs: 2 pipeline ranks x FSDP2 2 under 1F1B, GPipe and interleaved 1F1B (2 stages a rank), and 4
    pipeline ranks (FSDP2 over 1) under 1F1B; a local batch of 8 sequences in 8 micro-batches of one (on the tiny
    Llama of --dry-run: 2 and 4 of one, its 2 layers in 2 stages at most, so pp4 and the interleaved case are skipped)."""
    tiny = base is TINY
    b = dict(base, sharding="fsdp", world_size=WORLD, batch_size=2 if tiny else 8)
    out = [(f"pp2xfsdp2-1f1b-mb{b['batch_size']}-" + _tag(base), dict(b, pp=2)),
           (f"pp2xfsdp2-gpipe-mb{b['batch_size']}-" + _tag(base), dict(b, pp=2, pp_schedule="gpipe"))]
    if not tiny:
        out += [("pp2xfsdp2-interleaved-v2-mb8-" + _tag(base), dict(b, pp=2, pp_schedule="interleaved-1f1b", virtual_stages=2)),
                ("pp4-1f1b-mb8-" + _tag(base), dict(b, pp=4))]
    return out


def _tag(base: dict) -> str:
    return "tiny" if base is TINY else f"llama1b-ampbf16-L{base['seq_len']}"


PROFILES = {   # `memlens profile --world-size 4 ... --compare-estimate`: the CLI path (torchrun launched by memlens itself)
    "profile-hsdp2x2": ["--sharding", "hsdp", "--shard-size", "2"],
    "profile-tp2xfsdp2": ["--sharding", "fsdp", "--tp", "2"],
    "profile-cp2xfsdp2": ["--sharding", "fsdp", "--cp", "2"],
}


def profile_run(out: Path, name: str) -> str:
    """One `memlens profile` of Llama-3.2-1B amp-bf16 b4 L1024 on the 4 GPUs; its output kept in $OUT/<name>.txt."""
    import subprocess

    cmd = [sys.executable, "-m", "memlens.cli.main", "profile", "--model", "llama-3.2-1b", "--batch-size", "4", "--seq-len", "1024",
           "--precision", "amp-bf16", "--world-size", str(WORLD), *PROFILES[name], "--steps", "3", "--compare-estimate",
           "--out", str(out / name)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [q for q in os.environ.get("PYTHONPATH", "").split(os.pathsep) if q]),
               COLUMNS="160")
    t = time.time()
    try:
        p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
        text, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired:
        text, rc = "timeout", "timeout"
    (out / f"{name}.txt").write_text(" ".join(cmd[2:]) + "\n" + text)
    return f"{name}: rc={rc} {time.time() - t:.0f}s (output in {out / (name + '.txt')})"


def two_nodes_run(out: Path) -> str:
    """`memlens profile` as two nodes of 2 GPUs each on this host (issue 37, item 4): two agents started at once, GPUs 0-1
    and 2-3 (CUDA_VISIBLE_DEVICES), meeting at a c10d rendezvous on localhost; HSDP 2 x 2 (shard within a node, replicate
    across). The node whose agent got rank 0 writes every rank's record; each node's output and result.json kept under
    $OUT/profile-2nodes/node{0,1}."""
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = out / "profile-2nodes"
    base = [sys.executable, "-m", "memlens.cli.main", "profile", "--model", "llama-3.2-1b", "--batch-size", "4", "--seq-len", "1024",
            "--precision", "amp-bf16", "--world-size", str(WORLD), "--sharding", "hsdp", "--shard-size", "2", "--steps", "3",
            "--compare-estimate", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [q for q in os.environ.get("PYTHONPATH", "").split(os.pathsep) if q]),
               COLUMNS="160")
    t = time.time()
    procs = {k: subprocess.Popen(base + ["--out", str(d / f"node{k}")], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, env=dict(env, CUDA_VISIBLE_DEVICES=gpus), start_new_session=True)
             for k, gpus in ((0, "0,1"), (1, "2,3"))}
    lines = []
    for k, p in procs.items():
        try:
            text, _ = p.communicate(timeout=max(1, 360 - (time.time() - t)))
        except subprocess.TimeoutExpired:
            for q in procs.values():
                try:
                    os.killpg(q.pid, 9)
                except ProcessLookupError:
                    pass
            text = (p.communicate()[0] or "") + "\ntimeout"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"node{k}.txt").write_text(" ".join(base[2:]) + f" --out node{k}\n" + text)
        lines.append(f"node{k}: rc={p.returncode}")
    return f"profile-2nodes: {' '.join(lines)} {time.time() - t:.0f}s (outputs in {d})"


def gpu_name() -> str:
    import torch

    return "h200" if torch.cuda.is_available() and "H200" in torch.cuda.get_device_name(0) else "h100"


def estimate(fields: dict, gpu: str) -> dict:
    """memlens' per-rank estimate: {rank: (allocated, reserved)} for every rank, from the rank group standing for it.
    A pipeline case simulates the steps bench/pipeline_rank.py runs (its reserved peak is the reserved bytes after the
    last: a rank's caching allocator may still grow segments in step 3, as interleaved 1F1B's rank 0 does)."""
    from memlens.core.spec import TrainingSpec
    from memlens.estimator.ranks import estimate_ranks

    from bench.pipeline_rank import STEPS as PP_STEPS

    t = time.time()
    steps = PP_STEPS if fields.get("pp", 1) > 1 else 2
    r = estimate_ranks(TrainingSpec.from_dict(dict(fields, gpu=gpu)), steps=steps)
    per: dict[int, list[int]] = {}
    for e in r.data["ranks"]:
        for k in e["ranks"]:
            if e.get("simulated"):
                per[k] = [e["peak_allocated_bytes"], e["peak_reserved_bytes"]]
            else:      # between two simulated ranks: bounded by them (the higher reported)
                per[k] = [e["peak_allocated_bytes_between"][1], e["peak_reserved_bytes_between"][1]]
    return {"ranks": per, "strategy": r.data["strategy"], "applied": r.data.get("applied"), "steps": steps,
            "seconds": round(time.time() - t, 1)}


def mesh_case(name: str, fields: dict, dry: bool) -> dict:
    """One case, run through bench/gpu_runner.py: on the GPUs, one rank of its torchrun job (bench/gpu_distributed.py's
    rank code); with --dry-run, memlens' per-rank estimate of the tiny spec in the case's own CPU subprocess."""
    if dry:
        return {"spec": fields, "estimate": estimate(fields, "h100")}
    if fields.get("pp", 1) > 1:          # torch's own pipeline schedule over memlens' stages
        from bench.pipeline_rank import pp_rank_case

        return pp_rank_case(name, fields, dry)
    from bench.gpu_distributed import rank_case

    return rank_case(name, fields, dry)


def _estimate_meta(fields: dict, gpu: str) -> dict:
    """The runner's ``meta``: the spec and memlens' per-rank estimate of it, on the CPU in this process after the case's
    GPU run (one case's estimate failing loses that estimate only)."""
    try:
        est = estimate(fields, gpu)
    except Exception as e:  # noqa: BLE001
        est = {"error": f"{type(e).__name__}: {str(e)[:300]}", "ranks": {}}
    return {"spec": fields, "gpu": gpu, "estimate": est}


def _rank_est(est: dict, rank) -> list | None:
    per = est.get("ranks") or {}
    return per.get(rank, per.get(str(rank)))      # int keys in this process, str keys once read back from the JSONL


def markdown(recs: list[dict], env: dict) -> str:
    """Per rank: measured vs memlens' estimate (allocated and reserved), and the rank's NCCL memory."""
    lines = [f"{env.get('device', '?')} x {WORLD}, torch {env.get('torch', '?')}, NCCL {env.get('nccl', '?')}\n",
             "| case | rank | measured alloc GiB | estimate GiB | err | measured reserved GiB | estimate GiB | err | NCCL MiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for rec in recs:
        est = rec.get("estimate") or {}
        if not rec.get("ranks"):
            lines.append(f"| {rec['name']} | - | {rec.get('error', 'no rank record')} |||||||")
        for m in rec.get("ranks", []):
            e = _rank_est(est, m.get("rank"))
            if m.get("status") != "ok" or not e:
                lines.append(f"| {rec['name']} | {m.get('rank')} | {m.get('status')} {m.get('error') or est.get('error', '')} |||||||")
                continue
            ea, er = e
            lines.append(f"| {rec['name']} | {m['rank']} | {m['max_allocated'] / 2**30:.3f} | {ea / 2**30:.3f} | "
                         f"{100 * (ea - m['max_allocated']) / m['max_allocated']:+.2f}% | {m['max_reserved'] / 2**30:.3f} | "
                         f"{er / 2**30:.3f} | {100 * (er - m['max_reserved']) / m['max_reserved']:+.2f}% | "
                         f"{(m.get('nccl_bytes') or 0) / 2**20:.0f} |")
    return "\n".join(lines)


DRY_COLUMNS = [("estimate per rank MiB (tiny Llama)", lambda r: " ".join(
    f"r{k}={v[0] / 2**20:.2f}" for k, v in sorted(r["estimate"]["ranks"].items(), key=lambda kv: int(kv[0])))),
    ("strategy", lambda r: r["estimate"]["strategy"])]
COLUMNS = [("ranks: max allocated GiB", lambda r: " ".join(f"r{x['rank']}={gib(x.get('max_allocated'))}" for x in r.get("ranks", []))
            or "-")]


def reestimate(paths: list[str], out: Path, filters: list[str]) -> None:
    """No GPU: the measured records of earlier runs (their JSONL and the gpu_mesh_env.json beside each) estimated again
    with this checkout's memlens; written to OUT/gpu_mesh.jsonl and OUT/gpu_mesh.md (what bench/results commits)."""
    recs, env = [], {}
    for p in map(Path, paths):
        env = env or (json.loads((p.parent / "gpu_mesh_env.json").read_text()) if (p.parent / "gpu_mesh_env.json").exists() else {})
        recs += [r for n, r in last_records(read_jsonl(p)).items() if not filters or any(f in n for f in filters)]
    out.mkdir(parents=True, exist_ok=True)
    with open(out / JSONL, "w") as f:
        for rec in recs:
            gpu = rec.get("gpu") or ("h200" if "H200" in env.get("device", "") else "h100")
            rec = dict(rec, estimate=estimate(rec["spec"], gpu), estimated_by=_checkout())
            print(f"{rec['name']}: estimated again in {rec['estimate']['seconds']} s", flush=True)
            f.write(json.dumps(rec) + "\n")
    text = markdown([json.loads(line) for line in open(out / JSONL)], env)
    (out / "gpu_mesh.md").write_text(text + "\n")
    print("\n" + text)


def _checkout() -> str:
    import subprocess

    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()


def main(argv: list[str] | None = None) -> None:
    ap = runner_args(__doc__.splitlines()[0], timeout=CASE_TIMEOUT)
    ap.add_argument("--reestimate", nargs="+", metavar="JSONL", help="no GPU: earlier runs' records estimated again")
    a = ap.parse_args(argv)
    out = Path(a.out)
    if a.reestimate:
        reestimate(a.reestimate, out, a.filters)
        return
    profiles = [n for n in PROFILES if any(f in n for f in a.filters)]      # only when asked: `python bench/gpu_mesh.py profile`
    todo = cases(TINY if a.dry_run else LLAMA_1B)
    if a.list:
        list_or_run(a, todo)
        return
    run = dict(fn=mesh_case, jsonl=JSONL, env=CHILD_ENV)
    if a.dry_run:     # CPU only: every case's estimate on a tiny Llama (no GPU, no torchrun)
        list_or_run(a, todo, columns=DRY_COLUMNS, **run)
        return
    import torch

    if torch.cuda.device_count() < WORLD:
        sys.exit(f"needs {WORLD} GPUs, this machine has {torch.cuda.device_count()}")
    gpu = gpu_name()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}"]
    if select(as_cases(todo), a.filters):     # the GPU runs first (each its own torchrun job), each case's estimate after it
        list_or_run(a, todo, launcher=torchrun, columns=COLUMNS, meta=lambda c: _estimate_meta(c.payload, gpu), **run)
    for name in profiles:                      # the CLI path, after the per-case runs
        print(profile_run(out, name), flush=True)
    if any(f in "profile-2nodes" for f in a.filters):     # `python bench/gpu_mesh.py 2nodes`: two torchrun agents, one host
        print(two_nodes_run(out), flush=True)
    names = {c.name for c in select(as_cases(todo), a.filters)}
    recs = [r for n, r in last_records(read_jsonl(out / JSONL)).items() if n in names]
    env_path = out / "gpu_mesh_env.json"
    env = json.loads(env_path.read_text()) if env_path.exists() else {}
    if recs:
        print("\n" + markdown(recs, env))


if __name__ == "__main__":
    main()
