"""The training step: :func:`prepare` builds it from a TrainingSpec, :func:`train_step` runs it.

>>> from memlens.step import prepare, train_step, PreparedStep   # doctest: +SKIP
"""
from .loop import forward_loss, train_step
from .prepare import PreparedStep, amp_setup, prepare

__all__ = ["PreparedStep", "prepare", "train_step", "forward_loss", "amp_setup"]
