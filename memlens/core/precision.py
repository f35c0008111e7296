"""The precision modes a spec takes: the weights' dtype, the autocast dtype, and whether a GradScaler runs.

The one place that decides the GradScaler: ``amp-fp16`` (fp32 master weights under fp16 autocast) scales
the loss, as ``torch.amp.GradScaler`` does on CUDA; bf16 needs no scaling (its exponent is fp32's).

>>> PRECISIONS["amp-fp16"].grad_scaler, PRECISIONS["amp-bf16"].grad_scaler, PRECISIONS["bf16-amp"].weights
(True, False, 'bfloat16')
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Precision:
    name: str
    weights: str                 # the parameters' dtype (torch attribute name)
    autocast: str | None         # the autocast dtype, None: no autocast
    grad_scaler: bool            # torch.amp.GradScaler scales the loss (amp-fp16)

    @property
    def label(self) -> str:
        return self.name


PRECISIONS: dict[str, Precision] = {p.name: p for p in (
    Precision("fp32", "float32", None, False),
    Precision("fp16", "float16", None, False),
    Precision("bf16", "bfloat16", None, False),
    Precision("amp-fp16", "float32", "float16", True),
    Precision("amp-bf16", "float32", "bfloat16", False),
    Precision("bf16-amp", "bfloat16", "bfloat16", False),   # bf16 weights under bf16 autocast
)}
PRECISION_NAMES: tuple[str, ...] = tuple(PRECISIONS)


def precision_of(spec) -> Precision:
    return PRECISIONS[spec.precision]


__all__ = ["Precision", "PRECISIONS", "PRECISION_NAMES", "precision_of"]
