"""Stand-ins: fake tensors of a given storage size, made where a simulation writes events by hand
(:mod:`.periodic`, :mod:`.periodic_dp`) and then runs real code on tensors it did not run to make."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Meta:
    """What a stand-in needs to be: a storage of ``nbytes`` seen as (size, stride, offset, dtype)."""

    size: tuple
    stride: tuple
    offset: int
    dtype: Any
    nbytes: int

    @classmethod
    def of(cls, t: torch.Tensor) -> "Meta":
        return cls(tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, t.untyped_storage().nbytes())

    def make(self) -> torch.Tensor | None:
        """A new tensor (in the ambient fake mode) with a storage of exactly ``nbytes``; None if none can be."""
        item = self.dtype.itemsize
        if self.nbytes % item:
            return None
        base = torch.empty(self.nbytes // item, dtype=self.dtype)
        t = base if (self.size, self.stride, self.offset) == (tuple(base.shape), tuple(base.stride()), 0) else \
            base.as_strided(self.size, self.stride, self.offset)
        return t if t.untyped_storage().nbytes() == self.nbytes else None


def standin_meta(tracker, key) -> Meta | None:
    """A byte storage the size of the live storage ``key`` (a micro-batch's loss), or None if it is gone."""
    st = tracker.storage_of(key)
    return None if st is None else Meta((st.nbytes(),), (1,), 0, torch.uint8, st.nbytes())
