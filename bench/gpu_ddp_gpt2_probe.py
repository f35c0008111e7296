"""Why GPT-2 medium under DDP / DDP + ZeroRedundancyOptimizer peaks above memlens' estimate (issue 37, item 3).

GPT-2 medium, amp-bf16 (fp32 weights, autocast bf16), micro-batch 4 x 512 tokens, 2 ranks, 3 optimizer steps. Each
variant runs in its own torchrun job (2 processes) through bench/gpu_runner.py (variants already in the JSONL are
skipped, --fresh starts over, --list names them); every rank records, for steps 2-3 (after the warm-up step and
DDP's bucket rebuild), the peak of each phase (forward, backward, optimizer: max_memory_allocated reset at each
phase mark), the allocated bytes at every mark, max_memory_reserved, and on rank 0 a _record_memory_history trace of
steps 2-3 replayed to the peak moment: the blocks alive there grouped by phase, op and Python frame (the replay of
bench/gpu_dp_gap_probe.py). memlens' per-phase estimate of the same spec (expected and worst case) is computed in
this process after each variant's GPU run, and a table printed last.

Variants (the hypotheses):
  memlens-step    memlens.step.prepare's own step (what the estimate simulates; exact for GPT-2 small)
  user-plain      a plain user loop: DDP(model), AdamW, autocast around the forward, backward, step, zero_grad
  user-untied     the same with config.tie_word_embeddings=False (wte and lm_head two parameters)
  user-bucketview gradient_as_bucket_view=True
  user-static     static_graph=True
  user-unused     find_unused_parameters=True (what the HF Trainer passes without gradient checkpointing)
  user-bw-autocast  backward inside the autocast context (autocast's cast cache of the bf16 weights kept through it)
  zero1-step      memlens' step under --sharding zero1;  zero1-user: the user loop with ZeroRedundancyOptimizer
  then `memlens profile --world-size 2 --compare-estimate` for ddp and zero1 (the CLI's own torchrun launch; `profile`)

    python bench/gpu_ddp_gpt2_probe.py                 # 2 GPUs, everything (~8-10 min: better in the 3 parts below)
    python bench/gpu_ddp_gpt2_probe.py memlens-step user-plain user-untied user-bucketview
    python bench/gpu_ddp_gpt2_probe.py user-static user-unused user-bw-autocast zero1
    python bench/gpu_ddp_gpt2_probe.py profile          # memlens profile --world-size 2 for ddp and zero1
                                                        # (each part appends to $OUT (default ./out)/gpu_ddp_gpt2_probe.jsonl)
    python bench/gpu_ddp_gpt2_probe.py --dry-run        # CPU: tiny GPT-2, 2 gloo ranks per variant + the estimates
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.gpu_runner import Case, gib, last_records, list_or_run, read_jsonl, runner_args, select  # noqa: E402

WORLD, STEPS = 2, 3
JSONL = "gpu_ddp_gpt2_probe.jsonl"
CASE_TIMEOUT = 240
CHILD_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
GPT2M = dict(n_embd=1024, n_layer=24, n_head=16, n_positions=1024, vocab_size=50257)
TINY = dict(n_embd=64, n_layer=2, n_head=4, n_positions=128, vocab_size=128)
SHAPE = dict(batch_size=4, seq_len=512)
TINY_SHAPE = dict(batch_size=2, seq_len=32)

VARIANTS = {   # name: (runner, tied, DDP kwargs, backward inside autocast, ZeRO-1)
    "memlens-step": ("memlens", True, {}, False, False),
    "user-plain": ("user", True, {}, False, False),
    "user-untied": ("user", False, {}, False, False),
    "user-bucketview": ("user", True, {"gradient_as_bucket_view": True}, False, False),
    "user-static": ("user", True, {"static_graph": True}, False, False),
    "user-unused": ("user", True, {"find_unused_parameters": True}, False, False),
    "user-bw-autocast": ("user", True, {}, True, False),
    "zero1-step": ("memlens", True, {}, False, True),
    "zero1-user": ("user", True, {}, False, True),
}


def config_dir(out: Path, tied: bool, dry: bool) -> str:
    """A Hugging Face config directory for GPT-2 medium (or a tiny GPT-2), tied or not: the GPU run and the estimate read it."""
    d = out / "configs" / (("tiny-" if dry else "gpt2m-") + ("tied" if tied else "untied"))
    d.mkdir(parents=True, exist_ok=True)
    cfg = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], **(TINY if dry else GPT2M), "tie_word_embeddings": tied}
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def spec_fields(variant: str, cfg: str, dry: bool) -> dict:
    runner, tied, ddp_kw, _, zero1 = VARIANTS[variant]
    return dict(model=cfg, precision="amp-bf16", world_size=WORLD, sharding="zero1" if zero1 else "ddp",
                gradient_as_bucket_view=bool(ddp_kw.get("gradient_as_bucket_view")), **(TINY_SHAPE if dry else SHAPE))


# ------------------------------------------------------------------------------------------------ one rank
def rank_case(name: str, req: dict, dry: bool) -> dict:
    """One rank of one variant, run by torchrun through bench/gpu_runner.py (--dry-run: gloo ranks on the CPU); an OOM
    or a crash is this rank's record (status "crash", its phases so far) and the rank leaves at once."""
    import torch
    import torch.distributed as dist

    from bench.gpu_dp_gap_probe import Marks, analyze

    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    cuda = not dry
    rec: dict = {"rank": rank, "variant": name}
    try:
        dev = torch.device("cuda", local) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if cuda else "gloo", **({"device_id": dev} if cuda else {}))
        marks = Marks(cuda)
        phases: list[dict] = []

        def on_phase(mark: str, step: int) -> None:
            if cuda:
                torch.cuda.synchronize()
                phases.append({"step": step, "mark": mark, "allocated": torch.cuda.memory_allocated(),
                               "peak_since_last_mark": torch.cuda.max_memory_allocated()})
                torch.cuda.reset_peak_memory_stats()
            marks.mark(f"s{step}.{mark}")

        run = build_memlens(req, dev) if VARIANTS[name][0] == "memlens" else build_user(name, req, dev)
        rec["after_build_allocated"] = torch.cuda.memory_allocated() if cuda else None
        for n in range(1, STEPS + 1):
            if cuda and n == 2:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                if rank == 0:
                    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="all", max_entries=1_500_000)
                    marks.on = True
                    rec["alloc_at_record_start"] = torch.cuda.memory_allocated()
            run(lambda mark, n=n: on_phase(mark, n))
            on_phase("end", n)
        if cuda:
            rec["max_reserved"] = torch.cuda.memory_stats()["reserved_bytes.all.peak"]
            if rank == 0:
                snap = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(enabled=None)
                try:
                    rec["peak_analysis"] = analyze(snap, rec["alloc_at_record_start"], marks.names)
                except Exception as e:  # noqa: BLE001
                    rec["peak_analysis"] = {"error": repr(e)}
        later = [p for p in phases if p["step"] >= 2]
        rec.update(status="ok", phases=phases, max_allocated_steps23=max((p["peak_since_last_mark"] for p in later), default=None))
        dist.barrier()
    except Exception as e:  # noqa: BLE001 - an OOM or a crash: this variant's record says so (the runner exits the rank)
        import traceback

        rec.update(status="crash", error=f"{type(e).__name__}: {str(e)[:300]}", traceback=traceback.format_exc()[-2000:],
                   oom="out of memory" in str(e).lower())
        return rec
    dist.destroy_process_group()
    return rec


def build_memlens(req: dict, dev):
    """memlens' own prepared step (DDP or DDP + ZeroRedundancyOptimizer, as `memlens profile` runs it)."""
    from memlens.core.spec import TrainingSpec
    from memlens.step import prepare

    step = prepare(TrainingSpec.from_dict(req["spec"]), device=dev, seed=0)
    return lambda mark: step.run(mark)


def build_user(variant: str, req: dict, dev):
    """A plain user loop: the model on the device, DDP with the variant's options, AdamW (or ZeRO-1 over it)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoConfig, AutoModelForCausalLM

    _, tied, ddp_kw, bw_in_autocast, zero1 = VARIANTS[variant]
    torch.manual_seed(0)
    cfg = AutoConfig.from_pretrained(req["spec"]["model"])
    model = AutoModelForCausalLM.from_config(cfg).to(dev)
    assert (model.lm_head.weight is model.transformer.wte.weight) == tied
    ddp = DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None, **ddp_kw)
    if zero1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
    else:
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    b, t = req["spec"]["batch_size"], req["spec"]["seq_len"]
    ids = torch.randint(0, cfg.vocab_size, (b, t), device=dev)
    amp = (lambda: torch.autocast(dev.type, dtype=torch.bfloat16))

    def step(mark) -> None:
        mark("forward")
        with amp():
            loss = ddp(input_ids=ids, labels=ids).loss
            if bw_in_autocast:
                mark("backward")
                loss.backward()
        if not bw_in_autocast:
            mark("backward")
            loss.backward()
        del loss
        mark("optimizer")
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


# ------------------------------------------------------------------------------------------------ driver
def profile_cli(out: Path, sharding: str, dry: bool) -> str:
    """`memlens profile --world-size 2 --compare-estimate` of the same spec (memlens' own torchrun launch, as a user runs it);
    the output is kept in $OUT/profile-<sharding>.txt, the merged result in $OUT/profile-<sharding>/."""
    cfg = config_dir(out, True, dry)
    shape = TINY_SHAPE if dry else SHAPE
    cmd = [sys.executable, "-m", "memlens.cli.main", "profile", "--model", cfg, "--precision", "amp-bf16", "--batch-size",
           str(shape["batch_size"]), "--seq-len", str(shape["seq_len"]), "--world-size", str(WORLD), "--sharding", sharding,
           "--steps", "3", "--compare-estimate", "--out", str(out / f"profile-{sharding}")] + (["--device", "cpu"] if dry else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
               COLUMNS="160")
    try:
        p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
        text = p.stdout + p.stderr
    except subprocess.TimeoutExpired:
        text = "timeout"
    (out / f"profile-{sharding}.txt").write_text(" ".join(cmd[2:]) + "\n" + text)
    return "\n".join(text.splitlines()[:8])


def estimate(fields: dict) -> dict:
    """memlens' per-phase estimate of rank 0 (expected) and its worst case (DDP's stale buckets held)."""
    from memlens.core.spec import TrainingSpec
    from memlens.estimator.ranks import estimate_ranks

    r = estimate_ranks(TrainingSpec.from_dict(fields))
    e = next(x for x in r.data["ranks"] if x.get("rank") == 0 or x.get("simulated"))
    return {"peak_allocated": r.peak_allocated_bytes, "peak_reserved": r.peak_reserved_bytes,
            "worst_allocated": (r.data.get("worst_case") or {}).get("peak_allocated_bytes"),
            "by_phase": {k: v["peak_allocated_bytes"] for k, v in e["by_phase"].items()}, "terms": e.get("terms")}


def _estimate_meta(fields: dict, cache: dict) -> dict:
    """The runner's ``meta``: the variant's spec and memlens' estimate of it, on the CPU in this process after the
    variant's torchrun job (one estimate per distinct spec; one failing loses that estimate only)."""
    key = json.dumps(fields, sort_keys=True)
    if key not in cache:
        try:
            cache[key] = estimate(fields)
        except Exception as e:  # noqa: BLE001
            cache[key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    return {"spec": fields, "estimate": cache[key]}


def _phase_peaks(r: dict) -> dict:
    """A rank's peak per phase over steps 2-3 (each mark's peak is the peak since the previous mark)."""
    ph: dict = {}
    for p in r.get("phases", []):
        if p["step"] >= 2 and p["mark"] in ("backward", "optimizer", "end"):
            prev = {"backward": "forward", "optimizer": "backward", "end": "optimizer"}[p["mark"]]
            ph[prev] = max(ph.get(prev, 0), p["peak_since_last_mark"])
    return ph


def markdown(recs: list[dict]) -> str:
    g = lambda x: f"{x / 2**30:.3f}" if x else "-"   # noqa: E731
    lines = ["| variant | rank | measured peak (steps 2-3) | estimate expected | err | worst case | measured fwd / bwd / opt peak | "
             "estimated fwd / bwd / opt |", "|---|---|---|---|---|---|---|---|"]
    for rec in recs:
        est = rec.get("estimate") or {}
        if not rec.get("ranks"):
            lines.append(f"| {rec['name']} | - | {rec.get('error', 'no rank record')} ||||||")
        for r in rec.get("ranks", []):
            m, ph, e, bp = r.get("max_allocated_steps23"), _phase_peaks(r), est.get("peak_allocated"), est.get("by_phase", {})
            err = f"{100 * (e - m) / m:+.2f}%" if e and m else "-"
            lines.append(f"| {rec['name']} | {r['rank']} | {g(m)} | {g(e)} | {err} | {g(est.get('worst_allocated'))} | "
                         f"{' / '.join(g(ph.get(k)) for k in ('forward', 'backward', 'optimizer'))} | "
                         f"{' / '.join(g(bp.get(k)) for k in ('forward', 'backward', 'optimizer'))} |")
        pa = next((r.get("peak_analysis") for r in rec.get("ranks", []) if r.get("peak_analysis")), None)
        if pa and "top_groups" in pa:
            lines.append(f"  {rec['name']} rank 0 at its peak ({pa['peak_phase']}): "
                         + "; ".join(f"{x['key']} {x['bytes'] / 2**20:.0f} MiB" for x in pa["top_groups"][:6]))
    return "\n".join(lines)


COLUMNS = [("ranks: max allocated (steps 2-3) GiB",
            lambda r: " ".join(f"r{x['rank']}={gib(x.get('max_allocated_steps23'))}" for x in r.get("ranks", [])) or "-")]


def main(argv: list[str] | None = None) -> None:
    ap = runner_args(__doc__.splitlines()[0], timeout=CASE_TIMEOUT)
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dry = a.dry_run
    cases = [Case(v, {"spec": spec_fields(v, config_dir(out, VARIANTS[v][1], dry), dry)}) for v in VARIANTS]
    if a.list:
        list_or_run(a, cases)
        return
    if not dry:
        import torch

        if torch.cuda.device_count() < WORLD:
            sys.exit(f"needs {WORLD} GPUs, this machine has {torch.cuda.device_count()}")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}"]
    cache: dict[str, dict] = {}
    todo = select(cases, a.filters)
    if todo:     # each variant its own torchrun job (gloo ranks on the CPU with --dry-run), its estimate after it
        list_or_run(a, cases, fn=rank_case, jsonl=JSONL, launcher=torchrun, env=CHILD_ENV, columns=COLUMNS,
                    meta=lambda c: {"variant": c.name, **_estimate_meta(c.payload["spec"], cache)})
    if not a.filters or "profile" in a.filters:      # the CLI path a user takes (on the CPU with --dry-run: gloo)
        for sh in ("ddp", "zero1"):
            print(f"\nmemlens profile --sharding {sh}:\n" + profile_cli(out, sh, dry), flush=True)
    names = {c.name for c in todo}
    jsonl = out / (f"{Path(JSONL).stem}_dry.jsonl" if dry else JSONL)
    recs = [r for n, r in last_records(read_jsonl(jsonl)).items() if n in names]
    if recs:
        print("\n" + markdown(recs))


if __name__ == "__main__":
    main()
