"""DP-SGD over several GPUs with Opacus' ``DifferentiallyPrivateDistributedDataParallel`` (DPDDP),
for one rank: ``--dp --sharding ddp --world-size N``.

What Opacus does (opacus/distributed.py, opacus/optimizers/ddpoptimizer*.py, 1.5-1.6):

- ``DPDDP(model)`` broadcasts every parameter from rank 0 in place (``broadcast(p.data, 0)``) and
  forwards to the module: no Reducer, no gradient buckets (unlike torch's DDP);
- ``PrivacyEngine.make_private`` sees the DPDDP module and picks ``DistributedDPOptimizer``
  (hooks) or ``DistributedDPOptimizerFastGradientClipping`` (ghost); each rank clips its own
  per-sample gradients into ``summed_grad`` as on one GPU;
- ``add_noise``: only rank 0 draws the Gaussian noise and makes ``p.grad = summed_grad + noise``
  (a new gradient-sized tensor per parameter, plus the noise); every other rank sets
  ``p.grad = summed_grad.view_as(p)`` (no allocation). So rank 0 peaks higher by what the noise
  step allocates, the others hold one gradient copy less;
- ``reduce_gradients``: ``all_reduce(p.grad)`` in place per parameter, then ``p.grad /= N``
  (in place): NCCL's own buffers only (:mod:`memlens.core.gpus`, ``nccl_bytes``).

``--batch-size`` is each rank's logical batch (without Poisson sampling Opacus leaves each
rank's data loader as given; its expected batch size divides by N only for the noise scale).
"""
from __future__ import annotations

import contextlib

from ...core.spec import TrainingSpec
from ..fake import materialize_on_fake
from .base import RankGroup, Wrapper


class DPDDPWrapper(Wrapper):
    """Opacus' DPDDP on a device and on fake tensors alike (its broadcast runs on the fake process group)."""

    name = "dpddp"
    strategy = "Opacus DifferentiallyPrivateDistributedDataParallel (DPDDP) + DistributedDPOptimizer"

    def __init__(self, spec: TrainingSpec, **kw):
        super().__init__(spec, **kw)
        self.applied.append(f"Opacus DifferentiallyPrivateDistributedDataParallel over {self.world_size} GPUs "
                            "(no gradient buckets; per-parameter all-reduce in the DP optimizer; noise on rank 0)")

    def wrap(self, model, *, device, fake_mode=None):
        from opacus.distributed import DifferentiallyPrivateDistributedDataParallel  # optional: opacus (memlens[dp])

        if self.fake:
            model = materialize_on_fake(model, fake_mode)
            with fake_mode:
                return DifferentiallyPrivateDistributedDataParallel(model)
        return DifferentiallyPrivateDistributedDataParallel(model)

    @contextlib.contextmanager
    def simulation(self, tracker, step):
        """Keeps the DP step's pass marks (ghost clipping: backward 1 and backward 2) for the per-rank result."""
        self.pass_marks: list = []
        try:
            yield
        finally:
            dp = getattr(step, "dp", None)
            self.pass_marks = list(dp.passes) if dp is not None and dp.criterion is not None else []

    def rank_groups(self) -> list[RankGroup]:
        n = self.world_size
        groups = [RankGroup(0, (0,), "adds the Gaussian noise (a new gradient per parameter)")]
        if n > 1:
            groups.append(RankGroup(1, tuple(range(1, n)), "no noise: each gradient is a view of the summed clipped gradient"))
        return groups

    def inner(self, model):
        return getattr(model, "module", model)
