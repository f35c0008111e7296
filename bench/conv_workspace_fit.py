"""Summarize measured cuDNN convolution workspaces into memlens/estimator/conv_workspaces.json.

python bench/conv_workspace_fit.py OUT_DIR/gpu_generality_calibrate.jsonl OUT_DIR/gpu_generality_calibrate_env.json [GPU_NAME]

Per (pass, dtype, kind) class (see memlens/estimator/conv_workspaces.py): the ratio of the
measured transient (second call of each shape) to max(input bytes, output bytes), taken as the
class median (the median is robust to the one shape whose engine needs an unusual workspace;
the max is kept beside it for the record). The file says where the numbers come from.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    from memlens.estimator.conv_workspaces import kind

    jsonl, env_path = sys.argv[1], sys.argv[2]
    gpu = sys.argv[3] if len(sys.argv) > 3 else "h100"
    env = json.load(open(env_path)) if os.path.exists(env_path) else {}
    ratios: dict[str, list[float]] = defaultdict(list)
    peaks: dict[str, int] = defaultdict(int)
    for line in open(jsonl):
        rec = json.loads(line)
        if rec.get("group") != "conv" or "run1" not in rec:
            continue
        n, cin, cout, h, k, s, g = rec["shape"]
        r = rec["run1"]
        cls = kind((cout, cin // g, k, k), g, cin)
        base = max(r["input_bytes"], r["output_bytes"])
        for pass_, key in (("forward", "forward_transient"), ("backward", "backward_transient")):
            name = f"{pass_}|{rec['dtype']}|{cls}"
            ratios[name].append(r[key] / base)
            peaks[name] = max(peaks[name], r[key])
    rules = {k: {"ratio": round(statistics.median(v), 4), "max_ratio": round(max(v), 4), "max_bytes": peaks[k], "shapes": len(v)}
             for k, v in sorted(ratios.items())}
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "memlens/estimator/conv_workspaces.json")
    doc = json.load(open(path)) if os.path.exists(path) else {}
    doc[gpu] = {"source": f"bench/gpu_generality_calibrate.py conv on {env.get('device')} (torch {env.get('torch')}, cuDNN "
                          f"{env.get('cudnn')}), summarized by bench/conv_workspace_fit.py", "rules": rules}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    for k, v in rules.items():
        print(f"{k:32s} ratio {v['ratio']:.4f} (max {v['max_ratio']:.4f}, {v['shapes']} shapes)")


if __name__ == "__main__":
    main()
