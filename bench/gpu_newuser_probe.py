"""Real GPU peaks of "new user" training steps: DeBERTa classification, padded Llama batches, LoRA
dropout / gradient checkpointing, fp32 weights under bf16 autocast, QLoRA loaded as users load it.

Self-contained (torch, transformers, peft, bitsandbytes and the stdlib; does NOT import memlens, whose
package changes while this runs). Reuses bench.gpu_dp_gap_probe's Marks phase markers and analyze()
peak replay. Each case runs in a fresh subprocess (bench/gpu_runner.py: own caching allocator, allocator
statistics per process; cases already in OUT_DIR/gpu_newuser_partial.jsonl are skipped, --fresh starts over); a
few run side by side on one GPU (NU_WORKERS or --jobs, default 3).

Per case: the model is built from bench/gpu_newuser_<model>.json with random weights directly on the
device (QLoRA: saved once with save_pretrained, then from_pretrained with a BitsAndBytesConfig),
memlens' reference step (loss = step_loss(model, batch) returning only the loss; loss.backward();
opt.step(); opt.zero_grad(set_to_none=True)), torch.optim.AdamW(trainable, lr=1e-4), 3 steps.
Peak = torch.cuda.max_memory_allocated over steps 2-3 (reset after step 1); steps 2-3 recorded with
_record_memory_history and replayed (analyze) to list the blocks alive at the peak.

    python bench/gpu_newuser_probe.py OUT_DIR [name-substring ...]     # GPU
    python bench/gpu_newuser_probe.py --cpu-test [name-substring ...]  # tiny configs on the CPU, no bnb, no memory calls
"""
from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from bench.gpu_dp_gap_probe import Marks, _describe, _is_marker, analyze  # noqa: E402
from bench.gpu_runner import Case, last_records, read_jsonl, run_cases  # noqa: E402

GiB = 2 ** 30
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
L1, DEB, PY = "llama-3.2-1b", "deberta-v3-base", "pythia-410m"
Q1B_DIR = "/tmp/q1b"
Q1B_DIR_CPU = "/tmp/q1b_cpu"


def _case(name, model, task="causal", dtype="bf16", batch=4, seq=1024, pad=0, lora=None, ckpt=False, autocast=False, qlora=None):
    return dict(name=name, model=model, task=task, dtype=dtype, batch=batch, seq=seq, pad=pad, lora=lora, ckpt=ckpt,
                autocast=autocast, qlora=qlora)


CASES = [
    _case("deberta-cls", DEB, task="cls", dtype="fp32", batch=16, seq=256),
    _case("llama1b-pad25", L1, pad=256),
    _case("llama1b-nopad", L1),
    _case("llama1b-lora-drop05", L1, lora=0.05),
    _case("llama1b-lora-drop05-ckpt", L1, lora=0.05, ckpt=True),
    _case("llama1b-lora-drop0", L1, lora=0.0),
    _case("pythia410m-ampbf16", PY, dtype="fp32", batch=8, autocast=True),
    _case("qlora-kbit-1b", L1, batch=2, lora=0.05, qlora="kbit"),
    _case("qlora-1b", L1, batch=2, lora=0.05, qlora="plain"),
]

TINY = {
    "llama": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000},
    "deberta-v2": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "vocab_size": 1000},
    "gpt_neox": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "vocab_size": 1000},
}


def _dtype(s):
    import torch
    return {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[s]


def load_config(model_name, cpu_test):
    from transformers import AutoConfig

    spec = dict(json.load(open(os.path.join(HERE, f"gpu_newuser_{model_name}.json")))["config"])
    mt = spec.pop("model_type")
    if cpu_test:
        spec.update(TINY[mt])
    cfg = AutoConfig.for_model(mt, **spec)
    cfg.use_cache = False
    return cfg


def build_from_config(case, cpu_test):
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    cfg = load_config(case["model"], cpu_test)
    cls = AutoModelForSequenceClassification if case["task"] == "cls" else AutoModelForCausalLM
    with torch.device("cpu" if cpu_test else "cuda"):
        model = cls.from_config(cfg, dtype=_dtype(case["dtype"]))
    model.config.use_cache = False
    return model


def save_q1b(cpu_test):
    """Random-weight bf16 Llama-1B saved as safetensors (what a user's from_pretrained reads)."""
    import torch

    t0 = time.time()
    torch.manual_seed(0)
    model = build_from_config(_case("save", L1), cpu_test)
    path = Q1B_DIR_CPU if cpu_test else Q1B_DIR
    model.save_pretrained(path, safe_serialization=True)
    del model
    if not cpu_test:
        torch.cuda.empty_cache()
    return {"path": path, "files": sorted(os.listdir(path)), "seconds": round(time.time() - t0, 1)}


def load_qlora(case, cpu_test):
    import torch
    from transformers import AutoModelForCausalLM

    path = Q1B_DIR_CPU if cpu_test else Q1B_DIR
    if cpu_test:   # no bitsandbytes on the CPU: the same load without quantization
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    else:
        from transformers import BitsAndBytesConfig
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16)
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=q, dtype=torch.bfloat16, device_map={"": 0})
    model.config.use_cache = False
    return model


def param_bytes_by_dtype(model):
    seen, out, cls = set(), {}, {}
    for p in model.parameters():
        k = (p.data_ptr(), p.numel() * p.element_size())
        if k in seen:
            continue
        seen.add(k)
        key = f"{p.dtype}{'/trainable' if p.requires_grad else ''}"
        out[key] = out.get(key, 0) + k[1]
        cls[type(p).__name__] = cls.get(type(p).__name__, 0) + 1
    return {"bytes": out, "classes": cls}


def ckpt_info(model):
    info = {"is_gradient_checkpointing": None, "func": None, "layers_with_gc": 0}
    base = model
    for attr in ("get_base_model",):
        if hasattr(base, attr):
            base = getattr(base, attr)()
    info["is_gradient_checkpointing"] = getattr(base, "is_gradient_checkpointing", None)
    for m in base.modules():
        if getattr(m, "gradient_checkpointing", False) and hasattr(m, "_gradient_checkpointing_func"):
            info["layers_with_gc"] += 1
            if info["func"] is None:
                f = m._gradient_checkpointing_func
                info["func"] = f"{getattr(getattr(f, 'func', f), '__module__', '?')}.{getattr(getattr(f, 'func', f), '__name__', '?')} " \
                               f"kw={getattr(f, 'keywords', None)}"
    return info


def make_batch(case, cfg, dev, cpu_test):
    import torch

    B, T = (2, 64) if cpu_test else (case["batch"], case["seq"])
    if case["task"] == "cls":
        return {"input_ids": torch.randint(0, cfg.vocab_size, (B, T), device=dev),
                "labels": torch.randint(0, 2, (B,), device=dev)}
    ids = torch.randint(0, cfg.vocab_size, (B, T), device=dev)
    if not case["pad"]:
        return {"input_ids": ids, "labels": ids}
    n = 16 if cpu_test else case["pad"]
    mask = torch.ones(B, T, dtype=torch.long, device=dev)
    mask[:, T - n:] = 0
    labels = ids.clone()
    labels[:, T - n:] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def run_case(case, cpu_test=False):
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    cuda = not cpu_test
    dev = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    mem = (lambda: torch.cuda.memory_allocated()) if cuda else (lambda: 0)
    rec = {"case": case}
    if case["qlora"]:
        model = load_qlora(case, cpu_test)
    else:
        model = build_from_config(case, cpu_test)
    cfg = model.config
    rec["attn_implementation"] = getattr(cfg, "_attn_implementation", None)
    rec["alloc_after_build"] = mem()
    rec["params_after_build"] = param_bytes_by_dtype(model)
    if case["ckpt"]:
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()
    if case["qlora"] == "kbit":
        from peft import prepare_model_for_kbit_training
        model = prepare_model_for_kbit_training(model)
        rec["alloc_after_kbit_prep"] = mem()
    if case["lora"] is not None:
        from peft import LoraConfig, get_peft_model
        lcfg = LoraConfig(r=16, lora_alpha=32, target_modules=ALL_LINEAR, lora_dropout=case["lora"], bias="none",
                          task_type="CAUSAL_LM")
        model = get_peft_model(model, lcfg)
    model.train()
    rec["alloc_after_prep"] = mem()
    rec["params_after_prep"] = param_bytes_by_dtype(model)
    rec["ckpt"] = ckpt_info(model)
    rec["attn_implementation_final"] = getattr(model.config, "_attn_implementation", None)
    trainable = [p for p in model.parameters() if p.requires_grad]
    rec["trainable_params"] = sum(p.numel() for p in trainable)
    rec["trainable_dtypes"] = sorted({str(p.dtype) for p in trainable})
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    batch = make_batch(case, cfg, dev, cpu_test)
    rec["batch_shapes"] = {k: list(v.shape) for k, v in batch.items()}
    ac_dev = "cuda" if cuda else "cpu"

    def step_loss(m, b):          # memlens' reference step: only the loss leaves this function
        if case["autocast"]:
            with torch.autocast(ac_dev, dtype=torch.bfloat16):
                return m(**b).loss
        return m(**b).loss

    marks = Marks(cuda)
    steps, losses = [], []
    for n in (1, 2, 3):
        if cuda and n == 2:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            rec["alloc_at_record_start"] = mem()
            torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="all", max_entries=2_000_000)
            marks.on = True
        if cuda and n == 3:
            torch.cuda.synchronize()
            steps[-1]["peak"] = torch.cuda.max_memory_allocated()
            steps[-1]["peak_reserved"] = torch.cuda.max_memory_reserved()
            torch.cuda.reset_peak_memory_stats()
        steps.append({"step": n})
        t0 = time.perf_counter()
        marks.mark(f"s{n}.forward_loss")
        loss = step_loss(model, batch)
        marks.mark(f"s{n}.backward")
        loss.backward()
        marks.mark(f"s{n}.opt_step")
        opt.step()
        marks.mark(f"s{n}.zero_grad")
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        del loss
        marks.mark(f"s{n}.end")
        if cuda:
            torch.cuda.synchronize()
        steps[-1]["seconds"] = round(time.perf_counter() - t0, 3)
        steps[-1]["end_alloc"] = mem()
    if cuda:
        steps[-1]["peak"] = torch.cuda.max_memory_allocated()
        steps[-1]["peak_reserved"] = torch.cuda.max_memory_reserved()
        marks.on = False
        t0 = time.perf_counter()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        rec["snapshot_s"] = round(time.perf_counter() - t0, 2)
        rec["max_alloc_steps23"] = max(steps[1]["peak"], steps[2]["peak"])
        rec["max_reserved_steps23"] = max(steps[1]["peak_reserved"], steps[2]["peak_reserved"])
        rec["max_reserved_process"] = torch.cuda.memory_stats()["reserved_bytes.all.peak"]
        try:
            pa = analyze(snap, rec["alloc_at_record_start"], marks.names)
            pa["all_groups"] = all_groups(snap, pa["peak_event"], marks.names)
            rec["peak_analysis"] = pa
        except Exception as e:  # noqa: BLE001
            import traceback
            rec["peak_analysis"] = {"error": repr(e), "tb": traceback.format_exc()[-2000:]}
    rec["steps"] = steps
    rec["losses"] = losses
    return rec


def all_groups(snap, peak_i, marker_names):
    """Every block alive at the replayed peak, grouped by (alloc phase without the step, op, first 3 python frames)."""
    traces = snap["device_traces"]
    tr = max(traces, key=len) if traces else []
    acts = {e["action"] for e in tr}
    free_act = "free_requested" if "free_requested" in acts else "free_completed"
    alive, phase, k = {}, "start", 0
    for i, e in enumerate(tr):
        if i > peak_i:
            break
        a = e["action"]
        if a == "alloc":
            if _is_marker(e.get("frames")):
                phase = marker_names[k] if k < len(marker_names) else f"marker{k}"
                k += 1
            alive[e["addr"]] = (phase, e)
        elif a == free_act:
            alive.pop(e["addr"], None)
    groups = {}
    for ph, e in alive.values():
        d = _describe(e.get("frames"))
        what = (d["bw"] + ":" if d["bw"] else "") + str(d["op"] or d["native"])
        key = f"{ph.split('.', 1)[-1]} | {what} | {' < '.join(d['py'][:3]) or '-'}"
        g = groups.setdefault(key, {"bytes": 0, "n": 0, "sizes": {}})
        g["bytes"] += e["size"]
        g["n"] += 1
        g["sizes"][str(e["size"])] = g["sizes"].get(str(e["size"]), 0) + 1
    out = sorted(({"key": k, **v} for k, v in groups.items()), key=lambda g: -g["bytes"])
    for g in out:
        g["sizes"] = dict(sorted(g["sizes"].items(), key=lambda kv: -int(kv[0]) * kv[1])[:4])
    return out[:200]


# ------------------------------------------------------------------------------------------- driver
def case(name, c, dry):
    """One case (or the QLoRA checkpoint save) in its own subprocess (bench/gpu_runner.py); dry: --cpu-test."""
    t0 = time.time()
    rec = {"case": c, **save_q1b(dry)} if name == SAVE else run_case(c, cpu_test=dry)
    rec["wall_s"] = round(time.time() - t0, 1)
    return rec


def summary_lines(rec):
    c = rec["case"]
    if "error" in rec:
        return [f"{c['name']}: ERROR {rec['error']}", rec.get("tb", "")[-1500:]]
    st = rec["steps"]
    L = [f"== {c['name']}: max_alloc(steps2-3) {rec.get('max_alloc_steps23', 0) / GiB:.3f} GiB "
         f"reserved {rec.get('max_reserved_steps23', 0) / GiB:.3f} [step2 {st[1].get('peak', 0) / GiB:.3f}, step3 {st[2].get('peak', 0) / GiB:.3f}] "
         f"after_build {rec['alloc_after_build'] / GiB:.3f} after_prep {rec['alloc_after_prep'] / GiB:.3f} "
         f"record_start {rec.get('alloc_at_record_start', 0) / GiB:.3f} attn={rec['attn_implementation']}/{rec['attn_implementation_final']} "
         f"trainable={rec['trainable_params']} {rec['trainable_dtypes']} losses={[round(x, 3) for x in rec['losses']]}",
         f"   params_after_prep {rec['params_after_prep']}  ckpt {rec['ckpt']}"]
    pa = rec.get("peak_analysis", {})
    if "error" in pa:
        L.append(f"   analysis ERROR {pa['error']} {pa.get('tb', '')[-800:]}")
        return L
    if pa:
        L.append(f"   replayed peak {pa['replayed_peak'] / GiB:.3f} at {pa['peak_phase']} ({pa['peak_event_desc']}); pre-existing alive "
                 f"{pa['pre_existing_alive_at_peak'] / GiB:.3f}, traced alive {pa['traced_alive_at_peak'] / GiB:.3f} ({pa['n_traced_alive']} blocks)")
        for g in pa["all_groups"][:20]:
            L.append(f"   {g['bytes'] / 2**20:9.1f} MiB x{g['n']:<3d} {g['key']}  sizes={g['sizes']}")
        L.append("   top blocks:")
        for b in pa["top_blocks"][:8]:
            L.append(f"   {b['size'] / 2**20:9.1f} MiB alloc@{b['alloc_phase']} free@{b['free_phase']} op={b['op']} bw={b['bw']} "
                     f"native={b['native']} py={b['py'][:2]}")
    return L


SAVE = "__save_q1b__"


def main(argv=None):
    from bench.gpu_dp_gap_probe import CHILD_ENV, probe_args, versions

    a = probe_args(argv, "/tmp/gpu_newuser_cpu")
    cases = [c for c in CASES if not a.filters or any(w in c["name"] for w in a.filters)]
    if a.list:
        print("\n".join(c["name"] for c in cases))
        return
    env = versions(("transformers", "peft", "accelerate", "bitsandbytes"), a.dry_run)
    print(json.dumps(env), flush=True)
    jsonl = "gpu_newuser_partial.jsonl"
    run = dict(out=a.out, jsonl=jsonl, dry=a.dry_run, fresh=False, timeout=int(os.environ.get("NU_TIMEOUT", a.timeout)),
               jobs=a.jobs or int(os.environ.get("NU_WORKERS", "3")), env=CHILD_ENV, meta=lambda c: {"case": c.payload},
               env_file=False, quiet=True)
    if a.fresh:
        run_cases([], case, **{**run, "fresh": True})
    plain = [Case(c["name"], c) for c in cases if not c["qlora"]]
    need_q = any(c["qlora"] for c in cases)
    # the QLoRA checkpoint is saved beside the plain cases; the QLoRA cases load it, so they come after
    run_cases(plain + ([Case(SAVE, {"name": SAVE})] if need_q else []), case, **run)
    run_cases([Case(c["name"], c) for c in cases if c["qlora"]], case, **run)
    got = last_records(read_jsonl(os.path.join(a.out, jsonl.replace(".jsonl", "_dry.jsonl") if a.dry_run else jsonl)))
    save_rec = got.get(SAVE) if need_q else None
    ordered = [got.get(c["name"], {"case": c, "error": "no record"}) for c in cases]
    with open(os.path.join(a.out, "gpu_newuser_probe.jsonl"), "w") as f:
        f.write(json.dumps({"env": env, "save_q1b": save_rec}) + "\n")
        for r in ordered:
            f.write(json.dumps(r) + "\n")
    lines = [json.dumps(env)]
    for r in ordered:
        lines += summary_lines(r)
    lines.append("\n== table (GiB: max_memory_allocated / max_memory_reserved over steps 2-3)")
    for r in ordered:
        if "error" not in r:
            lines.append(f"{r['case']['name']:28s} {r.get('max_alloc_steps23', 0) / GiB:8.3f} {r.get('max_reserved_steps23', 0) / GiB:8.3f}  "
                         f"end_alloc {r['steps'][-1]['end_alloc'] / GiB:7.3f} record_start {r.get('alloc_at_record_start', 0) / GiB:7.3f} "
                         f"attn {r['attn_implementation_final']}")
        else:
            lines.append(f"{r['case']['name']:28s} ERROR {r['error'][:200]}")
    txt = "\n".join(lines)
    open(os.path.join(a.out, "gpu_newuser_summary.txt"), "w").write(txt + "\n")
    print(txt[-11000:])


if __name__ == "__main__":
    main()
