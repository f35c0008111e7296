"""The profiler must not change what the user's code observes: after a profiled run,
``torch.cuda.max_memory_allocated()`` reads what it reads without the profiler (GPU only).

Each run is a fresh process, so the allocator starts empty and the two runs allocate the same
blocks in the same order.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LOOP = textwrap.dedent("""
    import json, sys, torch
    import memlens.measure.profiler as mp
    mode = sys.argv[1]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(6)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(256, 2048, device="cuda")
    def loop():
        for _ in range(3):
            model(x).pow(2).mean().backward(); opt.step(); opt.zero_grad()
    if mode == "none":
        loop()
    else:
        with mp.profile(model, opt, mode=mode) as prof:
            loop()
    torch.cuda.synchronize()
    print(json.dumps({"max_allocated": torch.cuda.max_memory_allocated(), "max_reserved": torch.cuda.max_memory_reserved(),
                      "profiled_peak": prof.result.peak_allocated_bytes if mode != "none" else None}))
""")

TRAINER = textwrap.dedent("""
    import json, sys, tempfile, torch, transformers
    from memlens.integrations.hf import MemlensCallback
    class DS(torch.utils.data.Dataset):
        def __len__(self): return 16
        def __getitem__(self, i):
            ids = torch.randint(0, 1000, (128,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=1000, n_positions=128, n_embd=256, n_layer=4, n_head=4)
    model = transformers.GPT2LMHeadModel(cfg)
    args = transformers.TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=8, max_steps=3,
                                          logging_strategy="no", save_strategy="no", report_to=[], disable_tqdm=True,
                                          dataloader_num_workers=0)
    cbs = [MemlensCallback(mode=sys.argv[1])] if sys.argv[1] != "none" else []
    transformers.Trainer(model=model, args=args, train_dataset=DS(), callbacks=cbs).train()
    torch.cuda.synchronize()
    print(json.dumps({"max_allocated": torch.cuda.max_memory_allocated(),
                      "profiled_peak": cbs[0].result.peak_allocated_bytes if cbs else None}))
""")


def _run(code: str, mode: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["phases", "full"])
def test_profiler_leaves_the_peak_counters_alone(mode):
    plain = _run(LOOP, "none")
    prof = _run(LOOP, mode)
    assert prof["max_allocated"] == plain["max_allocated"]
    assert prof["max_reserved"] == plain["max_reserved"]
    assert prof["profiled_peak"] == plain["max_allocated"]   # the profiler's own figure is the true peak too


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["phases", "full"])
def test_hf_callback_leaves_the_peak_counters_alone(mode):
    pytest.importorskip("transformers")
    plain = _run(TRAINER, "none")
    with_cb = _run(TRAINER, mode)
    assert with_cb["max_allocated"] == plain["max_allocated"]
