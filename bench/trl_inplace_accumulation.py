"""The full fine-tuning TRL cases' +4-5.5% (bench/results/trl_inplace_accumulation.md): replay the simulated event
log of each case of a gpu_trl.jsonl with the tied embedding's two gradients summed in place (as autograd's
InputBuffer does on the GPU) instead of into a third [V, H] block (as it does under memlens' dispatch mode), and
print the peak beside the real one.

    python bench/trl_inplace_accumulation.py JSONL case [case ...]
"""
import sys, json
sys.path.insert(0, '.')
from memlens.core.spec import TrainingSpec
from memlens.core.events import ALLOC, FREE
from memlens.core.ledger import analyze, round_size
from memlens.estimator.simulate import simulate
import torch
recs = {json.loads(l)['case']: json.loads(l) for l in open(sys.argv[1])}
for name in sys.argv[2:]:
    r = recs[name]
    sim = simulate(TrainingSpec.from_dict(r['spec']))
    ev = sim.log.events
    # the out-of-place accumulations of the embedding's gradient: add.Tensor right after embedding_dense_backward
    skip = set()
    for i, e in enumerate(ev):
        if e[0] == ALLOC and 'embedding_dense_backward' in str(e[6] if len(e) > 6 else ''):
            for f in ev[i + 1:i + 12]:
                if f[0] == ALLOC and 'aten.add.Tensor' in str(f[6]) and f[2] == e[2]:
                    skip.add(f[1]); break
    live = peak = 0; sizes = {}
    for e in ev:
        if e[0] == ALLOC:
            if e[1] in skip: continue
            s = round_size(e[2]) if e[2] else 0; sizes[e[1]] = s; live += s; peak = max(peak, live)
        elif e[0] == FREE and e[1] in sizes:
            live -= sizes.pop(e[1])
    real = r['real_peak_allocated_bytes']
    print(name, 'skipped', len(skip), 'peak before', analyze(sim.log).peak_allocated_bytes / 2**30, 'in place', peak / 2**30,
          'real', real / 2**30, f'{peak / real - 1:+.2%}', flush=True)
