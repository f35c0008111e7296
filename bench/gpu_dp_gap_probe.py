"""Why real Opacus DP-SGD steps on tied-embedding LoRA models peak above memlens' estimate.

Self-contained (torch, transformers, peft, opacus only; does NOT import memlens, whose package is
being refactored while this runs). Each case runs in a fresh subprocess (bench/gpu_runner.py: own caching
allocator; cases already in OUT_DIR/gpu_dp_gap_probe_partial.jsonl are skipped, --fresh starts over); several
cases run side by side on one GPU (GAP_WORKERS or --jobs, default 4; allocator statistics are per process).

Per case: the model is built from bench/gpu_dp_gap_<model>.json with random weights directly on
the device in bf16 (tied or untied lm_head), peft LoRA r16, Opacus 1.6 make_private (hooks or
ghost; default Poisson sampling, whose sample rate is 1 here: the dataset is one logical batch),
optionally BatchMemoryManager, 3 optimizer steps. Peak = torch.cuda.max_memory_allocated over
steps 2-3 (reset after step 1). Steps 2-3 are recorded with _record_memory_history (python + C++
stacks); the trace is replayed to find the peak moment and the blocks alive at it, each with the
phase it was allocated in and freed in (phase markers are 512-byte allocations from _mark()).

Variants:
  loss  = "slice": the user's idiom, criterion(logits[:, :-1].reshape(-1, V).float(), ids[:, 1:].reshape(-1))
                   (ghost: the DPLossFastGradientClipping criterion with shape=(b, T-1))
          "hf":    hooks: model(input_ids=ids, labels=ids).loss (transformers' ForCausalLMLoss);
                   ghost: memlens' per-sample HF loss (logits.float(), labels padded+shifted, view, shape=(b, T))
  life  = "keep":  a user's loop: zero_grad(); logits = model(ids).logits; loss = ...; loss.backward(); step()
                   (logits / outputs stay bound through backward and into the next iteration)
          "drop":  memlens' loop: loss = f(batch) returning only the loss; backward; step; zero_grad(set_to_none=True)
                   "dropbw": the "keep" loop, but `del logits` right after the loss is computed

    python bench/gpu_dp_gap_probe.py OUT_DIR [name-substring ...]     # GPU
    python bench/gpu_dp_gap_probe.py --cpu-test                          # tiny configs on the CPU, no memory calls
"""
from __future__ import annotations

import json
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(HERE))
from bench.gpu_runner import Case, last_records, read_jsonl, run_cases, runner_args  # noqa: E402  (no memlens import)
GiB = 2 ** 30
QV = ["q_proj", "v_proj"]
QKVO = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _case(name, model, mode, loss, life, tied=True, batch=8, seq=256, physical=None, targets=None, rank=16):
    return dict(name=name, model=model, mode=mode, loss=loss, life=life, tied=tied, batch=batch, seq=seq,
                physical=physical, targets=targets or (QV if model.startswith("llama") else QKVO), rank=rank)


L1, Q3 = "llama-3.2-1b", "qwen3-0.6b"
CASES = [
    # the issue's step (user idiom + user loop) vs memlens' step (model's own loss, outputs dropped)
    _case("l1b-hooks-tied-slice-keep", L1, "hooks", "slice", "keep"),
    _case("l1b-hooks-tied-hf-drop", L1, "hooks", "hf", "drop"),
    _case("l1b-hooks-untied-slice-keep", L1, "hooks", "slice", "keep", tied=False),
    _case("l1b-hooks-untied-hf-drop", L1, "hooks", "hf", "drop", tied=False),
    _case("l1b-hooks-tied-slice-drop", L1, "hooks", "slice", "drop"),
    _case("l1b-hooks-tied-hf-keep", L1, "hooks", "hf", "keep"),
    _case("l1b-hooks-tied-slice-dropbw", L1, "hooks", "slice", "dropbw"),
    _case("l1b-ghost-tied-slice-keep", L1, "ghost", "slice", "keep"),
    _case("l1b-ghost-tied-hf-drop", L1, "ghost", "hf", "drop"),
    _case("l1b-ghost-untied-slice-keep", L1, "ghost", "slice", "keep", tied=False),
    _case("l1b-ghost-untied-hf-drop", L1, "ghost", "hf", "drop", tied=False),
    _case("l1b-ghost-tied-slice-drop", L1, "ghost", "slice", "drop"),
    _case("l1b-ghost-tied-hf-keep", L1, "ghost", "hf", "keep"),
    # Qwen3-0.6B-shaped, LoRA q,k,v,o, ghost, BatchMemoryManager (logical 8, physical 2) and without
    _case("q06-ghost-bmm2-slice-keep", Q3, "ghost", "slice", "keep", physical=2),
    _case("q06-ghost-bmm2-hf-drop", Q3, "ghost", "hf", "drop", physical=2),
    _case("q06-ghost-bmm2-slice-drop", Q3, "ghost", "slice", "drop", physical=2),
    _case("q06-ghost-bmm2-hf-keep", Q3, "ghost", "hf", "keep", physical=2),
    _case("q06-ghost-nobmm-slice-keep", Q3, "ghost", "slice", "keep"),
    _case("q06-ghost-nobmm-hf-drop", Q3, "ghost", "hf", "drop"),
    _case("q06-ghost-bmm4-slice-keep", Q3, "ghost", "slice", "keep", physical=4),
    _case("q06-ghost-bmm4-hf-drop", Q3, "ghost", "hf", "drop", physical=4),
    _case("q06-ghost-bmm2-untied-slice-keep", Q3, "ghost", "slice", "keep", physical=2, tied=False),
    _case("q06-ghost-bmm2-untied-hf-drop", Q3, "ghost", "hf", "drop", physical=2, tied=False),
]

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000}


# ------------------------------------------------------------------------------------------- one case
class Marks:
    """Phase markers: a 512-byte allocation made by mark() (found in the trace by its frame)."""

    def __init__(self, cuda):
        self.cuda = cuda
        self.on = False
        self.names: list[str] = []
        self.phase = "?"

    def mark(self, name):
        self.phase = name
        if self.on and self.cuda:
            import torch
            self.names.append(name)
            _m = torch.empty(512, dtype=torch.uint8, device="cuda")   # gpu_dp_gap_marker
            del _m


def build(case, cpu_test):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = json.load(open(os.path.join(HERE, f"gpu_dp_gap_{case['model']}.json")))["config"]
    spec = dict(spec)
    if cpu_test:
        spec.update(TINY)
    spec["tie_word_embeddings"] = case["tied"]
    mt = spec.pop("model_type")
    cfg = AutoConfig.for_model(mt, **spec)
    cfg.tie_word_embeddings = case["tied"]
    dev = "cpu" if cpu_test else "cuda"
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model, cfg


def tie_info(model):
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    return {"is": head is emb, "same_ptr": head.data_ptr() == emb.data_ptr()}


def unique_param_bytes(model):
    seen, total = set(), 0
    for p in model.parameters():
        k = (p.untyped_storage().data_ptr(), p.untyped_storage().nbytes())
        if k not in seen:
            seen.add(k)
            total += k[1]
    return total


def run_case(case, cpu_test=False):
    import warnings

    import torch
    import torch.nn as nn
    from opacus import PrivacyEngine
    from opacus.utils.batch_memory_manager import BatchMemoryManager
    from peft import LoraConfig, get_peft_model

    warnings.filterwarnings("ignore")
    cuda = not cpu_test
    dev = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    mem = (lambda: torch.cuda.memory_allocated()) if cuda else (lambda: 0)
    rec = {"case": case}
    model, cfg = build(case, cpu_test)
    V, H = cfg.vocab_size, cfg.hidden_size
    rec["tie_after_build"] = tie_info(model)
    rec["alloc_after_build"] = mem()
    rec["param_bytes_unique"] = unique_param_bytes(model)
    lcfg = LoraConfig(r=case["rank"], lora_alpha=2 * case["rank"], target_modules=case["targets"], lora_dropout=0.0,
                      bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(model, lcfg)
    model.train()
    rec["tie_after_peft"] = tie_info(model)
    rec["alloc_after_peft"] = mem()
    rec["lora_dtype"] = str(next(p.dtype for n, p in model.named_parameters() if p.requires_grad))
    rec["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)

    B, T = case["batch"], case["seq"]
    ids_all = torch.randint(0, V, (B, T))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids_all), batch_size=B)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ghost = case["mode"] == "ghost"
    engine = PrivacyEngine()
    out = engine.make_private(module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
                              grad_sample_mode=case["mode"], criterion=nn.CrossEntropyLoss())
    if ghost:
        model, opt, criterion, loader = out
    else:
        (model, opt, loader), criterion = out, nn.CrossEntropyLoss()
    rec["tie_after_make_private"] = tie_info(model._module)
    rec["alloc_after_make_private"] = mem()
    rec["param_bytes_unique_after"] = unique_param_bytes(model)

    marks = Marks(cuda)
    opt.original_optimizer.register_step_pre_hook(lambda o, a, k: marks.mark(marks.phase.rsplit(".", 1)[0] + ".inner_opt_step"))
    if ghost:
        orig_coef = model.get_clipping_coef

        def coef():
            marks.mark(marks.phase.rsplit(".", 1)[0] + ".ghost_between_passes")
            return orig_coef()
        model.get_clipping_coef = coef

    def hf_loss(m, ids):          # memlens' own step: only the loss leaves this function
        if not ghost:
            return m(input_ids=ids, labels=ids).loss
        logits = m(input_ids=ids).logits.float()
        labels = torch.nn.functional.pad(ids, (0, 1), value=-100)[..., 1:].contiguous()
        b, t, v = logits.shape
        return criterion(logits.view(-1, v), labels.view(-1), shape=(b, t))

    def slice_loss_of(logits, ids):
        b = logits.shape[0]
        kw = {"shape": (b, T - 1)} if ghost else {}
        return criterion(logits[:, :-1].reshape(-1, V).float(), ids[:, 1:].reshape(-1), **kw)

    def slice_loss(m, ids):
        return slice_loss_of(m(input_ids=ids).logits, ids)

    def physical_batches():
        if case["physical"]:
            with BatchMemoryManager(data_loader=loader, max_physical_batch_size=case["physical"], optimizer=opt) as ml:
                yield from ml
        else:
            yield from loader

    steps = []
    life, lossk = case["life"], case["loss"]

    def one_step(n):
        nonlocal logits, out_, loss
        k = 0
        for (ids,) in physical_batches():
            k += 1
            p = f"s{n}.p{k}"
            ids = ids.to(dev)
            if life == "drop":
                marks.mark(p + ".forward_loss")
                loss = (hf_loss if lossk == "hf" else slice_loss)(model, ids)
                marks.mark(p + ".backward")
                loss.backward()
                marks.mark(p + ".opt_step")
                opt.step()
                marks.mark(p + ".zero_grad")
                opt.zero_grad(set_to_none=True)
                del loss
                loss = None
            else:   # keep / dropbw: the user's loop; variables stay bound into the next iteration
                marks.mark(p + ".zero_grad")
                opt.zero_grad()
                marks.mark(p + ".forward")
                if lossk == "hf" and not ghost:
                    out_ = model(input_ids=ids, labels=ids)
                    marks.mark(p + ".loss")
                    loss = out_.loss
                    logits = out_.logits
                else:
                    logits = model(input_ids=ids).logits
                    marks.mark(p + ".loss")
                    if lossk == "hf":
                        lg = logits.float()
                        labels = torch.nn.functional.pad(ids, (0, 1), value=-100)[..., 1:].contiguous()
                        b, t, v = lg.shape
                        loss = criterion(lg.view(-1, v), labels.view(-1), shape=(b, t))
                        del lg
                    else:
                        loss = slice_loss_of(logits, ids)
                if life == "dropbw":
                    logits = out_ = None
                marks.mark(p + ".backward")
                loss.backward()
                marks.mark(p + ".opt_step")
                opt.step()
                marks.mark(p + ".end")
            steps[-1]["physical"].append(int(ids.shape[0]))

    logits = out_ = loss = None
    trace = None
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
            torch.cuda.reset_peak_memory_stats()
        steps.append({"step": n, "physical": []})
        t0 = time.perf_counter()
        one_step(n)
        if cuda:
            torch.cuda.synchronize()
        steps[-1]["seconds"] = round(time.perf_counter() - t0, 3)
        steps[-1]["end_alloc"] = mem()
    if cuda:
        steps[-1]["peak"] = torch.cuda.max_memory_allocated()
        marks.on = False
        t0 = time.perf_counter()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        rec["snapshot_s"] = round(time.perf_counter() - t0, 2)
        rec["max_alloc_steps23"] = max(steps[1]["peak"], steps[2]["peak"])
        rec["max_reserved"] = torch.cuda.memory_stats()["reserved_bytes.all.peak"]
        try:
            rec["peak_analysis"] = analyze(snap, rec["alloc_at_record_start"], marks.names)
        except Exception as e:  # noqa: BLE001
            import traceback
            rec["peak_analysis"] = {"error": repr(e), "tb": traceback.format_exc()[-2000:]}
    rec["steps"] = steps
    rec["tie_at_end"] = tie_info(model._module)
    rec["sizes_ref"] = {"V": V, "H": H, "VxH_bf16": V * H * 2,
                        "logits_bf16_BTV": B * T * V * 2 if not case["physical"] else case["physical"] * T * V * 2,
                        "sliced_bf16_B(T-1)V": (case["physical"] or B) * (T - 1) * V * 2,
                        "sliced_fp32_B(T-1)V": (case["physical"] or B) * (T - 1) * V * 4,
                        "logits_fp32_BTV": (case["physical"] or B) * T * V * 4}
    rec["loss_value"] = float(loss.detach() if hasattr(loss, "detach") else loss) if loss is not None else None
    return rec


# ------------------------------------------------------------------------------------------- trace replay
SKIP_PY = ("torch/nn/modules/module.py", "torch/_tensor.py", "torch/autograd/", "torch/utils/hooks.py", "contextlib.py",
           "torch/utils/_contextlib.py", "torch/cuda/memory.py", "torch/_compile.py", "torch/_dynamo/")
OP_RE = re.compile(r"at::_ops::(\w+)::(?:call|redispatch)")
BW_RE = re.compile(r"(?:generated::|autograd::)(\w*Backward\w*)::apply")
NATIVE_RE = re.compile(r"at::native::(\w+)")


def _short(fn):
    for cut in ("site-packages/", "dist-packages/", "/bench/"):
        if cut in fn:
            return fn.split(cut, 1)[1]
    return os.path.basename(fn)


def _describe(frames):
    py, op, bw, native = [], None, None, None
    for f in frames or []:
        fn, name = f.get("filename", ""), f.get("name", "")
        if fn.endswith(".py"):
            if not any(s in fn for s in SKIP_PY):
                py.append(f"{_short(fn)}:{f.get('line')}({name})")
        else:
            if op is None:
                m = OP_RE.search(name)
                if m:
                    op = m.group(1)
            if bw is None:
                m = BW_RE.search(name)
                if m:
                    bw = m.group(1)
            if native is None:
                m = NATIVE_RE.search(name)
                if m and "empty" not in m.group(1):
                    native = m.group(1)
    return {"py": py[:3], "op": op, "bw": bw, "native": native}


def _is_marker(frames):
    return any(f.get("name") == "mark" and str(f.get("filename", "")).endswith("gpu_dp_gap_probe.py") for f in frames or [])


def analyze(snap, base, marker_names):
    traces = snap["device_traces"]
    tr = max(traces, key=len) if traces else []
    actions = {}
    for e in tr:
        actions[e["action"]] = actions.get(e["action"], 0) + 1
    free_act = "free_requested" if actions.get("free_requested") else "free_completed"

    def replay(stop=None):
        alive, cur, peak, peak_i, phase, k = {}, base, base, -1, "start", 0
        pre_freed = []
        for i, e in enumerate(tr):
            if stop is not None and i > stop:
                break
            a = e["action"]
            if a == "alloc":
                if _is_marker(e.get("frames")):
                    phase = marker_names[k] if k < len(marker_names) else f"marker{k}"
                    k += 1
                alive[e["addr"]] = (i, phase, e)
                cur += e["size"]
            elif a == free_act:
                if e["addr"] in alive:
                    alive.pop(e["addr"])
                else:
                    pre_freed.append((phase, e["size"]))
                cur -= e["size"]
            if cur > peak:
                peak, peak_i = cur, i
        return alive, peak, peak_i, pre_freed

    _, peak, peak_i, pre_freed = replay()
    alive, _, _, pre_before_peak = replay(stop=peak_i)
    # phase of every event index, and the free index of each block alive at peak
    phase_at, phase, k = [], "start", 0
    for e in tr:
        if e["action"] == "alloc" and _is_marker(e.get("frames")):
            phase = marker_names[k] if k < len(marker_names) else f"marker{k}"
            k += 1
        phase_at.append(phase)
    free_idx = {}
    want = {addr for addr in alive}
    for i in range(peak_i + 1, len(tr)):
        e = tr[i]
        if e["action"] == free_act and e["addr"] in want and e["addr"] not in free_idx:
            free_idx[e["addr"]] = i
    blocks = []
    for addr, (i, ph, e) in alive.items():
        d = _describe(e.get("frames"))
        fi = free_idx.get(addr)
        blocks.append({"size": e["size"], "alloc_phase": ph, "free_phase": phase_at[fi] if fi is not None else "not freed in trace",
                       "alloc_i": i, "free_i": fi, **d})
    blocks.sort(key=lambda b: -b["size"])
    groups = {}
    for b in blocks:
        what = (b["bw"] + ":" if b["bw"] else "") + str(b["op"] or b["native"])
        key = f"{b['alloc_phase'].split('.', 1)[-1]} | {what} | {b['py'][0] if b['py'] else '-'}"
        g = groups.setdefault(key, {"bytes": 0, "n": 0})
        g["bytes"] += b["size"]
        g["n"] += 1
    top_groups = sorted(({"key": k, **v} for k, v in groups.items()), key=lambda g: -g["bytes"])[:15]
    pre_freed_total = sum(s for _, s in pre_before_peak)
    return {"events": len(tr), "actions": actions, "replayed_peak": peak, "peak_event": peak_i,
            "peak_phase": phase_at[peak_i] if 0 <= peak_i < len(phase_at) else "start",
            "peak_event_desc": _describe(tr[peak_i].get("frames")) if 0 <= peak_i < len(tr) else None,
            "base_at_record_start": base, "pre_existing_freed_before_peak": pre_freed_total,
            "pre_existing_alive_at_peak": base - pre_freed_total,
            "traced_alive_at_peak": sum(b["size"] for b in blocks), "n_traced_alive": len(blocks),
            "pre_existing_freed_by_phase": _by_phase(pre_freed),
            "top_groups": top_groups, "top_blocks": blocks[:15]}


def _by_phase(items):
    out = {}
    for ph, s in items:
        out[ph] = out.get(ph, 0) + s
    return {k: v for k, v in sorted(out.items(), key=lambda kv: -kv[1])[:12]}


# ------------------------------------------------------------------------------------------- driver
def case(name, c, dry):
    """One case in its own subprocess (bench/gpu_runner.py); dry (--cpu-test): tiny configs on the CPU."""
    t0 = time.time()
    rec = run_case(c, cpu_test=dry)
    rec["wall_s"] = round(time.time() - t0, 1)
    return rec


def summary_lines(rec):
    c = rec["case"]
    if "error" in rec:
        return [f"{c['name']}: ERROR {rec['error']}"]
    pa = rec.get("peak_analysis", {})
    L = [f"== {c['name']}: max_alloc(steps2-3) {rec.get('max_alloc_steps23', 0) / GiB:.3f} GiB "
         f"[step2 {rec['steps'][1].get('peak', 0) / GiB:.3f}, step3 {rec['steps'][2].get('peak', 0) / GiB:.3f}] "
         f"after_build {rec['alloc_after_build'] / GiB:.3f} after_make_private {rec['alloc_after_make_private'] / GiB:.3f} "
         f"record_start {rec.get('alloc_at_record_start', 0) / GiB:.3f} tied={rec['tie_after_build']} -> {rec['tie_at_end']} phys={rec['steps'][1]['physical']}"]
    if "error" in pa:
        L.append(f"   analysis ERROR {pa['error']}")
        return L
    if pa:
        L.append(f"   replayed peak {pa['replayed_peak'] / GiB:.3f} at {pa['peak_phase']} ({pa['peak_event_desc']}); pre-existing alive "
                 f"{pa['pre_existing_alive_at_peak'] / GiB:.3f}, traced alive {pa['traced_alive_at_peak'] / GiB:.3f} ({pa['n_traced_alive']} blocks)")
        for g in pa["top_groups"]:
            L.append(f"   {g['bytes'] / 2**20:9.1f} MiB x{g['n']:<3d} {g['key']}")
        L.append("   top blocks:")
        for b in pa["top_blocks"][:10]:
            L.append(f"   {b['size'] / 2**20:9.1f} MiB alloc@{b['alloc_phase']} free@{b['free_phase']} op={b['op']} bw={b['bw']} "
                     f"native={b['native']} py={b['py'][:2]}")
    return L


def probe_args(argv, cpu_out):
    """OUT_DIR [names] | --cpu-test [names] (the documented forms) on the runner's flags; GAP/NU env knobs kept."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--cpu-test" in argv:
        argv = [cpu_out, "--dry-run"] + [a for a in argv if a != "--cpu-test"]
    ap = runner_args(__doc__.splitlines()[0], out_positional=True)
    ap.add_argument("--jobs", type=int, default=None, help="cases at once on the one GPU")
    return ap.parse_args(argv)


def versions(mods, cpu_test):
    import torch

    env = {"torch": torch.__version__}
    for m in mods:
        try:
            env[m] = __import__(m).__version__
        except Exception as e:  # noqa: BLE001
            env[m] = f"missing: {e!r}"[:200]
    if not cpu_test:
        env["device"] = torch.cuda.get_device_name(0)
    return env


CHILD_ENV = {"OMP_NUM_THREADS": "2", "TORCH_SYMBOLIZE_MODE": os.environ.get("TORCH_SYMBOLIZE_MODE", "dladdr")}


def main(argv=None):
    a = probe_args(argv, "/tmp/gpu_dp_gap_cpu")
    cases = [c for c in CASES if not a.filters or any(w in c["name"] for w in a.filters)]
    if a.list:
        print("\n".join(c["name"] for c in cases))
        return
    env = versions(("transformers", "peft", "opacus"), a.dry_run)
    print(json.dumps(env), flush=True)
    jsonl = "gpu_dp_gap_probe_partial.jsonl"
    run_cases([Case(c["name"], c) for c in cases], case, out=a.out, jsonl=jsonl, dry=a.dry_run, fresh=a.fresh,
              timeout=int(os.environ.get("GAP_TIMEOUT", a.timeout)), jobs=a.jobs or int(os.environ.get("GAP_WORKERS", "4")),
              env=CHILD_ENV, meta=lambda c: {"case": c.payload}, env_file=False, quiet=True)
    got = last_records(read_jsonl(os.path.join(a.out, jsonl.replace(".jsonl", "_dry.jsonl") if a.dry_run else jsonl)))
    recs = [got.get(c["name"], {"case": c, "error": "no record"}) for c in cases]
    with open(os.path.join(a.out, "gpu_dp_gap_probe.jsonl"), "w") as f:
        f.write(json.dumps({"env": env}) + "\n")
        for r in recs:
            f.write(json.dumps(r) + "\n")
    lines = []
    for r in recs:
        lines += summary_lines(r)
    lines.append("\n== table (GiB, max_memory_allocated over steps 2-3)")
    for r in recs:
        if "error" not in r:
            lines.append(f"{r['case']['name']:40s} {r.get('max_alloc_steps23', 0) / GiB:8.3f}  end_alloc {r['steps'][-1]['end_alloc'] / GiB:7.3f}  "
                         f"record_start {r.get('alloc_at_record_start', 0) / GiB:7.3f}")
    txt = "\n".join(lines)
    open(os.path.join(a.out, "gpu_dp_gap_probe_summary.txt"), "w").write(txt + "\n")
    print(txt[-9000:])


if __name__ == "__main__":
    main()
