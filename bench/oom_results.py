"""Read what bench/gpu_oom.py measured on the GPU and check issue 14's done-means on it (CPU).

    python bench/oom_results.py OUT        # writes bench/results/oom_gpu.json and oom_gpu.md

Checks: every captured message gets its expected verdict and (hidden PID) names this process by its
numbers; the planted OOM's report categories sum to memory_allocated() at the failure within 1%
and its snapshot opens with torch.cuda._memory_viz; adaptive runs started at twice the micro-batch
end with the reference's losses (float tolerance); the guard's overhead without OOMs.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

LOSS_TOLERANCE = 1e-4      # relative, per step: fp32 sums in another order, atomics in embedding backward
CATEGORY_TOLERANCE = 0.01  # the issue's "within 1%"
OVERHEAD_LIMIT = 0.01      # the issue's "under 1% step time"


def _records(out: Path) -> list[dict]:
    f = out / "gpu_oom.jsonl"
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()] if f.exists() else []


def check_messages(out: Path) -> list[dict]:
    from memlens.doctor.oom import diagnose, parse_oom

    rows = []
    for txt in sorted((out / "fixtures").glob("gpu_oom_*.txt")):
        truth = json.loads(txt.with_suffix(".json").read_text())
        d = diagnose(parse_oom(txt.read_text()))
        acc = d.account
        rows.append({"case": txt.stem.removeprefix("gpu_oom_"), "expected": truth.get("expected_diagnosis"),
                     "diagnosis": d.diagnosis, "certain": d.certain, "ok": d.diagnosis == truth.get("expected_diagnosis"),
                     "this_process_line": truth.get("this_process_line"), "process_lines": truth.get("process_lines"),
                     "method": truth.get("hidden_method"), "self_source": acc.this_process_source,
                     "self_pid": acc.this_process_pid, "other_pid": truth.get("other_pid")})
    return rows


def summarize(out: Path, write: bool = False) -> dict:
    recs = _records(out)
    res: dict = {"messages": [], "guard_planted": [], "guard_overhead": [], "adaptive": [], "errors": []}
    try:
        res["messages"] = check_messages(out)
    except Exception as e:  # noqa: BLE001
        res["errors"].append(f"messages: {type(e).__name__}: {e}")
    for r in recs:
        part = r.get("part", "")
        if "error" in r and part != "adaptive_plain":
            res["errors"].append(f"{part} {r.get('case', '')}: {str(r['error'])[-300:]}")
        if part == "messages":
            res.setdefault("message_tries", []).append({k: r.get(k) for k in ("case", "hidden", "tries", "rc")})
        elif part == "guard_planted" and "report" in r:
            rep = r["report"]
            cats = rep.get("by_category") or {}
            viz = r.get("memory_viz", {})
            res["guard_planted"].append({
                "case": r["case"], "diagnosis": rep.get("diagnosis"), "allocated_at_failure": (r.get("independent") or {}).get("allocated"),
                "categories_sum": rep.get("categories_sum_bytes"), "error": r.get("categories_vs_independent"),
                "within_1pct": r.get("categories_vs_independent") is not None and abs(r["categories_vs_independent"]) <= CATEGORY_TOLERANCE,
                "parameters": cats.get("parameters"), "parameters_expected": r.get("param_bytes_expected"),
                "optimizer_state": cats.get("optimizer_state"), "optimizer_state_expected": r.get("optimizer_state_bytes_expected"),
                "by_category": cats, "memory_viz_opens": all(isinstance(v, int) and v > 0 for v in viz.values()) and len(viz) == 4,
                "memory_viz": viz, "files": r.get("files"), "snapshot_bytes": r.get("snapshot_bytes"),
                "observer_calls": r.get("observer_calls"), "guard_errors": r.get("guard_errors")})
        elif part == "guard_overhead" and "overhead" in r:
            res["guard_overhead"].append({"case": r["case"], "step_ms": 1000 * r["median_step_s"]["none"],
                                          "overhead": r["overhead"], "overhead_ms": r["overhead_ms"], "steps": r["steps"],
                                          "default_under_1pct": r["overhead"]["guard"] < OVERHEAD_LIMIT})
        elif part in ("adaptive_plain", "adaptive_hf"):
            ad, ref, no = r.get("adaptive", {}), r.get("reference", {}), r.get("no_adaptive", {})
            res["adaptive"].append({
                "kind": part.removeprefix("adaptive_"), "fraction": r.get("fraction"), "error": r.get("error"),
                "reference_ok": bool(ref.get("losses")) and "oom" not in ref,
                "started_at_2m_without_adaptive": no.get("oom", "no OOM")[:80] if no else None,
                "changes": [(c["micro_batch_from"], c["micro_batch_to"], c["reason"], c["step"]) for c in ad.get("changes", [])],
                "adaptive_losses": ad.get("losses"), "reference_losses": ref.get("losses"),
                "max_rel_loss_diff": r.get("max_rel_loss_diff"),
                "losses_match": r.get("max_rel_loss_diff") is not None and r["max_rel_loss_diff"] <= LOSS_TOLERANCE,
                "ooms_recovered": ad.get("ooms_recovered"), "windows_redone": ad.get("windows_redone")})
        elif part == "adaptive_trend":
            ad, no = r.get("adaptive", {}), r.get("without_adaptive", {})
            first = (ad.get("ooms_before_each_change") or [[None, None]])[0]
            res["trend"] = {"ballast_bytes": r.get("ballast_bytes"), "without_adaptive_oom_step": no.get("oom_at_step"),
                            "changes": [(c["micro_batch_from"], c["micro_batch_to"], c["reason"], c["step"]) for c in ad.get("changes", [])],
                            "first_change_reason": first[0], "ooms_before_first_change": first[1],
                            "adaptive_oom_step": ad.get("oom_at_step"), "adaptive_steps_done": len(ad.get("losses", []))}
    env = next((r["env"] for r in recs if "env" in r), {})
    res["env"] = env
    res["table"] = table(res)
    if write:
        d = REPO / "bench" / "results"
        (d / "oom_gpu.json").write_text(json.dumps({k: v for k, v in res.items() if k != "table"}, indent=1, default=str) + "\n")
        (d / "oom_gpu.md").write_text(markdown(res))
    return res


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f} MiB"


def table(res: dict) -> str:
    lines = ["messages: case | expected | got | certain | 'this process' line | recognized as"]
    for m in res["messages"]:
        lines.append(f"  {m['case']} | {m['expected']} | {m['diagnosis']} | {m['certain']} | {m['this_process_line']} | "
                     f"{m['self_source']} {m['self_pid'] or ''}")
    for g in res["guard_planted"]:
        lines.append(f"guard {g['case']}: {g['diagnosis']}; categories {_mib(g['categories_sum'])} vs memory_allocated "
                     f"{_mib(g['allocated_at_failure'])} ({100 * (g['error'] or 0):+.3f}%); memory_viz opens: {g['memory_viz_opens']}")
    for o in res["guard_overhead"]:
        lines.append(f"overhead {o['case']} ({o['step_ms']:.1f} ms/step): " +
                     ", ".join(f"{k} {100 * v:+.2f}%" for k, v in o["overhead"].items()))
    for a in res["adaptive"]:
        lines.append(f"adaptive {a['kind']}: changes {a['changes']}, max loss diff {a['max_rel_loss_diff']}, "
                     f"match: {a['losses_match']}")
    if "trend" in res:
        t = res["trend"]
        lines.append(f"trend: first change {t['first_change_reason']} after {t['ooms_before_first_change']} OOMs; "
                     f"without adaptive OOM at step {t['without_adaptive_oom_step']}")
    lines += [f"ERROR {e}" for e in res["errors"]]
    return "\n".join(lines)


def markdown(res: dict) -> str:
    env = res.get("env", {})
    p = [f"# Issue 14 on {env.get('device', 'a GPU')} (torch {env.get('torch')}, transformers {env.get('transformers')})", "",
         "Measured by `bench/gpu_oom.py`, checked by `bench/oom_results.py`.", "", "## OOM messages captured on the GPU", "",
         "| case | expected | diagnosis | certain | 'this process' line | process lines | this process recognized as | hidden by |",
         "|---|---|---|---|---|---|---|---|"]
    for m in res["messages"]:
        p.append(f"| {m['case']} | {m['expected']} | {m['diagnosis']} {'ok' if m['ok'] else '**WRONG**'} | {m['certain']} | "
                 f"{m['this_process_line']} | {m['process_lines']} | {m['self_source']} {m['self_pid'] or ''} | {m['method'] or '-'} |")
    p += ["", "## The guard at a planted OOM (GPT-2 small, AdamW, bf16 autocast)", "",
          "| case | diagnosis | memory_allocated() at the failure | categories sum | error | parameters (expected) | optimizer state (expected) | _memory_viz |",
          "|---|---|---|---|---|---|---|---|"]
    for g in res["guard_planted"]:
        p.append(f"| {g['case']} | {g['diagnosis']} | {_mib(g['allocated_at_failure'])} | {_mib(g['categories_sum'])} | "
                 f"{100 * (g['error'] or 0):+.3f}% | {_mib(g['parameters'])} ({_mib(g['parameters_expected'])}) | "
                 f"{_mib(g['optimizer_state'])} ({_mib(g['optimizer_state_expected'])}) | {'opens' if g['memory_viz_opens'] else g['memory_viz']} |")
    p += ["", "## The guard's overhead without OOMs (median step, interleaved rounds)", "",
          "| case | step (no guard) | guard (default) | history=False | module_depth=0 |", "|---|---|---|---|---|"]
    for o in res["guard_overhead"]:
        ov, ms = o["overhead"], o["overhead_ms"]
        p.append(f"| {o['case']} | {o['step_ms']:.1f} ms | " + " | ".join(
            f"{100 * ov[k]:+.2f}% ({ms[k]:+.2f} ms)" for k in ("guard", "guard history=False", "guard module_depth=0")) + " |")
    p += ["", "## Adaptive micro-batching started at twice the micro-batch that fits", "",
          "| loop | memory fraction | without adaptive | changes (from, to, reason, step) | OOMs recovered | max relative loss difference vs the reference | match |",
          "|---|---|---|---|---|---|---|"]
    for a in res["adaptive"]:
        p.append(f"| {a['kind']} | {a['fraction']:.4f} | {a['started_at_2m_without_adaptive']} | {a['changes']} | "
                 f"{a['ooms_recovered']} | {a['max_rel_loss_diff']} | {a['losses_match']} |" if a["fraction"] else
                 f"| {a['kind']} | - | - | - | - | {a['error']} | - |")
    if "trend" in res:
        t = res["trend"]
        p += ["", "## The trend acting before an OOM (a 512 MiB/step leak, ~6 GiB left on the GPU)", "",
              f"- without adaptive: OOM at step {t['without_adaptive_oom_step']}",
              f"- adaptive: changes {t['changes']}; the first came from `{t['first_change_reason']}` after "
              f"{t['ooms_before_first_change']} OOMs; {t['adaptive_steps_done']} steps done, OOM at step {t['adaptive_oom_step']}"]
    if res["errors"]:
        p += ["", "## Errors", ""] + [f"- {e}" for e in res["errors"]]
    return "\n".join(p) + "\n"


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__)
        sys.exit(2)
    r = summarize(Path(sys.argv[1]), write=True)
    print(r["table"])
