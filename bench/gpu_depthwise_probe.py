"""A depthwise convolution by input layout, and the layout Hugging Face's ConvNeXt feeds it (issue 36).

ConvNeXt-T's step was priced 15x its measured time: its depthwise 7 x 7 convolutions were priced as GEMMs of one
output channel a group (and torch's flop counter counts their weight gradients as if ungrouped). This times one at
ConvNeXt-T's first stage (bf16 [64, 96, 56, 56], 7 x 7, groups 96) over an NCHW and a channels-last input, forward
and backward (both gradients), beside a copy of the input; then records the strides of the input of each depthwise
convolution in a real ConvNeXt-T step (under autocast). The time model keys the two layouts apart
(memlens.estimator.timing.ops: ``convolution/depthwise`` and ``.../nhwc``, measured by calibrate).

    python bench/gpu_depthwise_probe.py --out $OUT/depthwise_probe_h200.json     # on a GPU
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def measure(out: str) -> dict:
    import torch

    from memlens.measure.calibrate import _gpu_seconds

    dev, F, a = torch.device("cuda"), torch.nn.functional, torch.ops.aten
    res: dict = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "us": {}}

    def timed(name, fn):
        res["us"][name] = round(_gpu_seconds(torch, fn, budget_s=0.05) * 1e6, 1)
        print(name, res["us"][name], "us", flush=True)

    x = torch.randn(64, 96, 56, 56, device=dev, dtype=torch.bfloat16)
    w = torch.randn(96, 1, 7, 7, device=dev, dtype=torch.bfloat16)
    b = torch.randn(96, device=dev, dtype=torch.bfloat16)
    for layout, xx in (("nchw", x), ("nhwc", x.contiguous(memory_format=torch.channels_last))):
        timed(f"{layout} forward", lambda xx=xx: F.conv2d(xx, w, b, padding=3, groups=96))
        y = F.conv2d(xx, w, b, padding=3, groups=96)
        g = torch.randn_like(y)
        timed(f"{layout} backward", lambda xx=xx, g=g: a.convolution_backward.default(
            g, xx, w, [96], [1, 1], [3, 3], [1, 1], False, [0, 0], 96, [True, True, True]))
    timed("copy of the input", lambda: x.clone())

    from transformers import ConvNextConfig, ConvNextForImageClassification

    model = ConvNextForImageClassification(ConvNextConfig()).to(dev)
    seen = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Conv2d) and mod.groups > 1:
            mod.register_forward_pre_hook(lambda m, inp, name=name: seen.append(
                {"module": name, "shape": list(inp[0].shape), "stride": list(inp[0].stride()),
                 "channels_last": inp[0].is_contiguous(memory_format=torch.channels_last)}))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(torch.randn(64, 3, 224, 224, device=dev)).logits.sum().backward()
    res["hf_convnext_depthwise_inputs"] = seen
    print(f"{sum(s['channels_last'] for s in seen)} of {len(seen)} depthwise inputs channels-last", flush=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "depthwise_probe.json"))
    measure(ap.parse_args(argv).out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
