"""cuDNN convolution workspaces, from measurements (the one place the simulation reads them).

A cuDNN convolution takes a workspace through PyTorch's caching allocator for the duration of
the call (aten/src/ATen/native/cudnn/Conv_v8.cpp: the plan's workspace is allocated with the
CUDA caching allocator, then freed), so it shows in ``max_memory_allocated`` when a convolution
runs at the step's peak (a CNN's first backward convolutions run when all activations are
live). Its size is whatever the engine cuDNN's heuristics pick needs: it is not derivable from
the shapes, so it is measured (bench/gpu_generality_calibrate.py, group ``conv``) and summarized
per class by bench/conv_workspace_fit.py into conv_workspaces.json beside this file:

    workspace = ratio[pass, dtype, kind] x max(input bytes, output bytes)

with pass forward | backward, kind 1x1 | kxk | depthwise | grouped. Depthwise convolutions in
fp32/bf16 run PyTorch's own kernel (``_conv_depthwise2d``: no workspace); the measurement shows it
as a ratio of 0. A GPU with no measured entry gets no workspace, and the Result says so.
"""
from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources


@lru_cache(maxsize=None)
def table() -> dict:
    try:
        return json.loads(resources.files("memlens.estimator").joinpath("conv_workspaces.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def kind(weight_shape, groups: int, in_channels: int) -> str:
    if groups > 1:
        return "depthwise" if groups == in_channels and weight_shape[1] == 1 else "grouped"
    return "1x1" if all(k == 1 for k in weight_shape[2:]) else "kxk"


def calibrated(gpu: str) -> bool:
    return bool(table().get(gpu, {}).get("rules"))


def workspace_bytes(gpu: str, pass_: str, dtype, weight_shape, groups: int, in_channels: int, in_bytes: int, out_bytes: int) -> int:
    """The measured class's workspace for one convolution call (0 when not calibrated)."""
    rules = table().get(gpu, {}).get("rules", {})
    rule = rules.get(f"{pass_}|{str(dtype).replace('torch.', '')}|{kind(weight_shape, groups, in_channels)}")
    if not rule:
        return 0
    return int(rule["ratio"] * max(in_bytes, out_bytes))
