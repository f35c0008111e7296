"""How much a layer's GEMMs slow down beside NCCL all-reduces, issued as DDP issues them (issue 36).

Under DDP over 2 H100s, Llama-3.2-1B's backward `aten::mm` took 37.0 ms against 25.9 alone (+43%,
bench/results/step_time_h100.md, eighth session), while calibrate's overlap probe (large GEMMs queued, then
collectives) saw the GEMMs lose 7-10% per second of NCCL beside them. This probe times the same GEMM sequence on the
compute stream three ways, on every GPU at once (one process each, an NCCL group):

- alone;
- interleaved: after every ``--every`` GEMMs one 25 MiB all-reduce is issued on a side stream (DDP's bucket becomes
  ready and the Reducer launches its all-reduce while the backward goes on);
- up front: the same all-reduces issued before the GEMMs (calibrate's order since the eighth session's finding).

GEMMs are a layer's backward shapes (tokens x hidden x intermediate, bf16). Prints and writes OUT/overlap_pattern.json:
the compute stream's seconds each way, the all-reduces' seconds, and the GEMMs' extra seconds per second of NCCL.

    python bench/gpu_overlap_pattern_probe.py --out $OUT [--tokens 4096 --hidden 2048 --inter 8192 --every 7]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _worker(rank: int, world: int, a: argparse.Namespace, path: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{path}.store", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    from memlens.measure.calibrate_nccl import BUCKET_BYTES, layer_gemms

    mats = layer_gemms(torch, a.tokens, a.hidden, a.inter)
    bucket = torch.empty(BUCKET_BYTES // 2, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    Ev = torch.cuda.Event

    def run(mode: str, layers: int) -> tuple[float, float]:
        dist.barrier()
        torch.cuda.synchronize()
        s0, e0, s1, e1 = (Ev(enable_timing=True) for _ in range(4))
        works = []
        if mode == "upfront":
            with torch.cuda.stream(side):
                s1.record(side)
                works = [dist.all_reduce(bucket, async_op=True) for _ in range(layers * len(mats) // a.every)]
        s0.record()
        n = 0
        for _ in range(layers):
            for x, y in mats:
                torch.mm(x, y)
                n += 1
                if mode == "interleaved" and n % a.every == 0:
                    with torch.cuda.stream(side):
                        if not works:
                            s1.record(side)
                        works.append(dist.all_reduce(bucket, async_op=True))
        e0.record()
        if works:
            with torch.cuda.stream(side):
                for w in works:
                    w.wait()
                e1.record(side)
        torch.cuda.synchronize()
        return s0.elapsed_time(e0) / 1e3, (s1.elapsed_time(e1) / 1e3 if works else 0.0)

    out: dict = {"world": world, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "shapes": [(x.shape[0], x.shape[1], y.shape[1]) for x, y in mats], "every": a.every, "layers": a.layers}
    for _ in range(2):
        run("alone", 2)
    comm_alone = []
    for _ in range(3):
        dist.barrier()
        torch.cuda.synchronize()
        s, e = Ev(enable_timing=True), Ev(enable_timing=True)
        with torch.cuda.stream(side):
            s.record(side)
            ws = [dist.all_reduce(bucket, async_op=True) for _ in range(a.layers * len(mats) // a.every)]
            for w in ws:
                w.wait()
            e.record(side)
        torch.cuda.synchronize()
        comm_alone.append(s.elapsed_time(e) / 1e3)
    out["comm_alone_s"] = statistics.median(comm_alone)
    for mode in ("alone", "interleaved", "upfront"):
        vals = [run(mode, a.layers) for _ in range(a.repeats)]
        out[mode] = {"compute_s": statistics.median(v[0] for v in vals), "comm_s": statistics.median(v[1] for v in vals)}
    alone = out["alone"]["compute_s"]
    for mode in ("interleaved", "upfront"):
        m = out[mode]
        m["compute_extra_pct"] = round(100 * (m["compute_s"] - alone) / alone, 1)
        m["extra_per_comm_second"] = round((m["compute_s"] - alone) / max(min(m["comm_s"], m["compute_s"]), 1e-9), 3)
        m["comm_slowdown"] = round(m["comm_s"] / max(out["comm_alone_s"], 1e-9), 3)
    if rank == 0:
        with open(path, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "./out"))
    ap.add_argument("--tokens", type=int, default=4096)      # Llama-3.2-1B at 4 x 1,024
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=8192)
    ap.add_argument("--every", type=int, default=7, help="GEMMs between two all-reduces (DDP's bucket pace)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    import torch
    import torch.multiprocessing as mp

    world = torch.cuda.device_count()
    if world < 2:
        print("ERROR: needs 2 or more GPUs", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "res.json")
        mp.spawn(_worker, args=(world, a, path), nprocs=world, join=True)
        res = json.load(open(path))
    with open(os.path.join(a.out, "overlap_pattern.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: res[k] for k in ("device", "comm_alone_s", "alone", "interleaved", "upfront")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
