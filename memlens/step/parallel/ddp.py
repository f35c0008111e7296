"""DistributedDataParallel (and ZeRO-1 on top of it) for one rank.

On a real device this is ``torch.nn.parallel.DistributedDataParallel``. Its C++ ``Reducer`` cannot
run on fake CPU tensors, so a simulated rank gets :class:`SimulatedReducer`, which allocates what
the Reducer allocates, when it does (torch/csrc/distributed/c10d/reducer.cpp, comm.cpp and
nn/parallel/distributed.py, torch 2.x):

- construction: ``_verify_param_shape_across_processes`` copies 2 x sum(param.dim()) int64 of
  shape metadata to the device and frees it; ``_sync_module_states`` broadcasts parameters and
  buffers with ``broadcast_coalesced``: buckets of at most 250 MiB (``broadcast_bucket_size``,
  grouped by ``_compute_bucket_assignment_by_size``), each flattened into one new tensor
  (``flatten_dense_tensors``; a one-tensor bucket is a view), at most 2 in flight;
- the Reducer's buckets: ``at::empty`` flat gradient buffers. With ``find_unused_parameters=False``
  (the default) the first assignment is ONE bucket per dtype holding every trainable parameter
  (``bucket_size_limits = [sys.maxsize]``), in reverse parameter order;
- backward: ``mark_variable_ready_dense`` copies each gradient into its bucket view (``mul_out``,
  no allocation); with ``gradient_as_bucket_view`` the parameter's ``.grad`` then *becomes* the
  bucket view and the gradient autograd produced is freed. After ``zero_grad(set_to_none=True)``
  autograd makes a fresh gradient every step and the swap happens again, so gradients are bucket
  views only from the moment each is ready;
- the second forward: ``_rebuild_buckets`` re-assigns parameters in the order their gradients
  became ready in the first backward, with a first bucket of ``_DEFAULT_FIRST_BUCKET_BYTES``
  (1 MiB, only when ``bucket_cap_mb`` is left at its default) and then ``bucket_cap_mb`` (25 MiB)
  buckets: two small int32 tensors carry the assignment from rank 0 (``sync_bucket_indices``), the
  Reducer drops the old buckets and allocates the new ones. The old ones are not freed yet: each
  NCCL all-reduce of step 1 stashes its tensors in its Work so the caching allocator cannot recycle
  them while the collective runs, and the Reducer waits on the Work's future, not on the Work, so
  the stash goes only when ProcessGroupNCCL's watchdog thread (which wakes every 100 ms) reaps the
  completed Work. Measured on 2 x H200 (torch 2.11, NCCL 2.28): the old set was still allocated at
  step 2's peak on one or both ranks of every DDP case (GPT-2 +498 MB, Llama-3.2-1B +2.47 GB), from
  step 2's forward to as late as step 3's forward. A simulated rank keeps it until step 3's forward,
  the worst case, unless ``HOLD_STALE_BUCKETS`` is False (the expected case: reaped before the
  rebuild); whether a given rank sees it depends on the watchdog's timing, so
  :mod:`memlens.estimator.ranks` simulates both and reports the expected peak with the worst case beside it. ZeRO-1 too:
  its first optimizer step builds its partitions and blocks on one broadcast per parameter, often
  long enough for the watchdog to reap step 1's Works before the rebuild, not always (measured on
  2 x H200, GPT-2 medium amp-bf16: memlens' own step without the stale set, a plain user loop over
  ZeroRedundancyOptimizer with it on both ranks, bench/gpu_ddp_gpt2_probe.py);
- every forward: buffers are broadcast from rank 0 (``broadcast_buffers=True``) through the same
  ``broadcast_coalesced`` flats.

The all-reduce itself runs in place on the bucket; NCCL's own buffers are outside the caching
allocator (see :mod:`memlens.core.gpus`, ``nccl_bytes``).

>>> import torch
>>> params = [torch.empty(300_000), torch.empty(100), torch.empty(300_000)]   # fp32: 1.2 MB, 400 B, 1.2 MB
>>> # ready order 2, 1, 0: param 2 alone passes the 1 MiB first cap; 1 and 0 share a 25 MiB bucket
>>> bucket_bytes(params, order=[2, 1, 0], cap_bytes=25 * 2**20, first_cap_bytes=2**20)
[1200000, 1200400]
"""
from __future__ import annotations

import collections
import contextlib
import contextvars
import inspect
import sys
from typing import Any

from ...core.enums import Category
from ...core.spec import TrainingSpec
from ..fake import materialize_on_fake
from ..optim import make_optimizer
from .base import RankGroup, Wrapper

MiB = 1 << 20
# False: simulate the expected case, the watchdog reaping step 1's Works before the rebuild (no stale
# set); memlens.estimator.ranks reports that as the peak and the default (stale set held) as the worst case
HOLD_STALE_BUCKETS: contextvars.ContextVar[bool] = contextvars.ContextVar("memlens_ddp_hold_stale", default=True)
BROADCAST_BUCKET_BYTES = 250 * MiB          # DistributedDataParallel.broadcast_bucket_size
DEFAULT_BUCKET_CAP_MB = 25                  # DistributedDataParallel(bucket_cap_mb=None) -> 25
MAX_IN_FLIGHT = 2                           # comm.cpp broadcast_coalesced: "maximum of 2 in flight"


def first_bucket_bytes() -> int:
    """``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB)."""
    import torch.distributed as dist  # heavy: torch, loaded on first use

    return int(getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", MiB))


def bucket_caps(spec: TrainingSpec) -> tuple[int, int]:
    """(first bucket cap, bucket cap) in bytes for the rebuilt buckets."""
    cap = int((spec.bucket_cap_mb if spec.bucket_cap_mb is not None else DEFAULT_BUCKET_CAP_MB) * MiB)
    first = first_bucket_bytes() if spec.bucket_cap_mb is None else cap
    return first, cap


def assign_buckets(tensors: list, limits: list[int], order: list[int] | None = None) -> list[list[int]]:
    """PyTorch's own ``_compute_bucket_assignment_by_size`` (reads shapes and dtypes only, so it runs
    on fake tensors). ``order``: tensor indices in the order given (the rebuild passes ready order)."""
    import torch.distributed as dist  # heavy: torch, loaded on first use

    if order is None:
        idx, _ = dist._compute_bucket_assignment_by_size(tensors, limits, [False] * len(tensors))
    else:
        idx, _ = dist._compute_bucket_assignment_by_size([tensors[i] for i in order], limits, [False] * len(tensors), list(order))
    return [list(b) for b in idx]


def bucket_bytes(params: list, *, order: list[int], cap_bytes: int, first_cap_bytes: int) -> list[int]:
    """Bytes of each rebuilt bucket for gradients becoming ready in ``order`` (parameter indices)."""
    buckets = assign_buckets(params, [first_cap_bytes, cap_bytes], order)
    return [sum(params[i].numel() * params[i].element_size() for i in b) for b in buckets]


def _same_storage(a, b) -> bool:
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata


class SimulatedReducer:
    """What DDP's Reducer allocates, on fake tensors (see the module docstring)."""

    def __init__(self, model, spec: TrainingSpec):
        import torch  # heavy: torch, loaded on first use

        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.module_states = [p for p in model.parameters()] + [b for b in model.buffers()]
        self.buffers = [b for b in model.buffers()]
        self.first_cap, self.cap = bucket_caps(spec)
        self.as_view = spec.gradient_as_bucket_view
        self.buckets: list[Any] = []
        self.hold_stale = True                     # the old buckets live on in step 1's NCCL Works (see above)
        self.stale: list[Any] = []
        self.views: dict[int, Any] = {}
        self.ready_order: list[int] = []
        self._seen: set[int] = set()
        self.forwards = 0
        self.rebuilt = False
        self.tracker = None
        self.history: list[dict[str, Any]] = []
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        self._handles.append(model.register_forward_pre_hook(self._pre_forward, prepend=True))
        del torch

    # -- allocations, all through the tracker (inside its dispatch mode)
    def _comm(self, t):
        if self.tracker is not None:
            self.tracker.retag(t, Category.COMMUNICATION)
        return t

    def _broadcast_coalesced(self, tensors: list) -> None:
        import torch  # heavy: torch, loaded on first use

        if not tensors:
            return
        in_flight: collections.deque = collections.deque()
        for b in assign_buckets(tensors, [BROADCAST_BUCKET_BYTES]):
            if len(in_flight) >= MAX_IN_FLIGHT:
                in_flight.popleft()
            if len(b) == 1:
                in_flight.append(None)            # flatten_dense_tensors of one tensor is a view
                continue
            n = sum(tensors[i].numel() for i in b)
            in_flight.append(self._comm(torch.empty(n, dtype=tensors[b[0]].dtype)))
        in_flight.clear()

    def _allocate(self, bucket_indices: list[list[int]]) -> None:
        import torch  # heavy: torch, loaded on first use

        self.buckets, self.views = [], {}
        sizes = []
        for b in bucket_indices:
            n = sum(self.params[i].numel() for i in b)
            flat = self._comm(torch.empty(n, dtype=self.params[b[0]].dtype))
            off = 0
            for i in b:
                p = self.params[i]
                self.views[i] = flat.as_strided(p.shape, p.stride(), off) if p.is_contiguous() else flat.narrow(0, off, p.numel()).view(p.shape)
                off += p.numel()
            self.buckets.append(flat)
            sizes.append(n * flat.element_size())
        self.history.append({"forward": self.forwards, "bucket_bytes": sizes})

    def construct(self, tracker) -> None:
        """DDP's constructor, inside the tracker: shape check, module-state broadcast, first buckets."""
        import torch  # heavy: torch, loaded on first use

        self.tracker = tracker
        meta = self._comm(torch.empty(2 * sum(p.dim() for p in self.params), dtype=torch.int64))
        del meta
        self._broadcast_coalesced(self.module_states)
        first = assign_buckets(self.params, [sys.maxsize])
        self._allocate(list(reversed(first)))

    # -- hooks
    def _pre_forward(self, module, args):
        import torch  # heavy: torch, loaded on first use

        if not torch.is_grad_enabled() or self.tracker is None:
            return None
        self.forwards += 1
        if not self.rebuilt and self.forwards >= 2 and len(self.ready_order) == len(self.params):
            self._rebuild()
        elif self.stale and self.forwards >= 3:
            self.stale = []                        # the watchdog has reaped step 1's Works
        self._broadcast_coalesced(self.buffers)
        return None

    def _rebuild(self) -> None:
        import torch  # heavy: torch, loaded on first use

        order = list(self.ready_order)
        new = assign_buckets(self.params, [self.first_cap, self.cap], order)
        indices = self._comm(torch.empty(len(self.params) + 1, dtype=torch.int32))
        sizes = self._comm(torch.empty(len(new), dtype=torch.int32))
        del sizes, indices
        # buckets_.clear(): only NCCL's stash holds the old ones now (communication, even where they held gradients)
        self.stale = [self._comm(b) for b in self.buckets] if self.hold_stale else []
        self.buckets, self.views = [], {}
        self._allocate(new)
        self.rebuilt = True

    def _on_grad(self, p) -> None:
        i = self.index.get(id(p))
        if i is None or self.tracker is None:
            return
        if not self.rebuilt and i not in self._seen:
            self._seen.add(i)
            self.ready_order.append(i)
        view = self.views[i]
        g = p.grad
        if g is not None and not _same_storage(g, view) and self.as_view:
            p.grad = view                          # mul_out into the view, then grad = bucket_view

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


class DDPWrapper(Wrapper):
    """``DistributedDataParallel`` on a device; :class:`SimulatedReducer` on fake tensors."""

    name = "ddp"
    # The first step whose memory repeats: step 2 rebuilds the buckets, so step 3 is the first to run on the rebuilt
    # layout, and its free blocks differ from step 2's (measured on 4 x H200, every DDP / ZeRO-1 rank that peaked
    # without the old buckets: ZeRO-1 Llama-3.2-1B reserved 13.418 GiB, 2 simulated steps give 12.439, 3 and 4 give
    # 13.418; DDP Llama-3.2-1B 16.824 measured, 15.846 / 16.824; DDP GPT-2 medium 12.043 measured, 11.654 / 12.039)
    steady_step = 3

    def __init__(self, spec: TrainingSpec, **kw):
        super().__init__(spec, **kw)
        self.reducer: SimulatedReducer | None = None
        first, cap = bucket_caps(spec)
        self.facts.update(bucket_cap_bytes=cap, first_bucket_cap_bytes=first, gradient_as_bucket_view=spec.gradient_as_bucket_view,
                          broadcast_bucket_bytes=BROADCAST_BUCKET_BYTES)
        view = ", gradient_as_bucket_view" if spec.gradient_as_bucket_view else ""
        self.applied.append(f"DistributedDataParallel over {self.world_size} GPUs (buckets {cap / MiB:g} MiB{view})")

    def wrap(self, model, *, device, fake_mode=None):
        if self.fake:
            model = materialize_on_fake(model, fake_mode)
            self.reducer = SimulatedReducer(model, self.spec)
            self.reducer.hold_stale = HOLD_STALE_BUCKETS.get()
            return model
        from torch.nn.parallel import DistributedDataParallel  # heavy: torch, loaded on first use

        kw: dict[str, Any] = {"gradient_as_bucket_view": self.spec.gradient_as_bucket_view}
        if self.spec.bucket_cap_mb is not None:
            kw["bucket_cap_mb"] = self.spec.bucket_cap_mb
        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids, **kw)

    @contextlib.contextmanager
    def simulation(self, tracker, step):
        self.reducer.construct(tracker)
        try:
            yield
        finally:
            self.facts["buckets"] = self.reducer.history
            self.facts["grad_ready_order_length"] = len(self.reducer.ready_order)

    def inner(self, model):
        return getattr(model, "module", model)


class Zero1Wrapper(DDPWrapper):
    """DDP + ``torch.distributed.optim.ZeroRedundancyOptimizer`` over the spec's optimizer."""

    name = "zero1"

    def __init__(self, spec: TrainingSpec, **kw):
        super().__init__(spec, **kw)
        self.applied.append("ZeroRedundancyOptimizer: optimizer states of this rank's share of the parameters")
        self.loads: list[int] = []

    def make_optimizer(self, spec: TrainingSpec, model, simulate: bool):
        from torch.distributed.optim import ZeroRedundancyOptimizer  # heavy: torch, loaded on first use

        plain = make_optimizer(spec, model, simulate=simulate)
        cls = type(plain)
        accepted = inspect.signature(cls.__init__).parameters
        defaults = {k: v for k, v in plain.defaults.items() if k in accepted}
        params = [p for g in plain.param_groups for p in g["params"]]
        del plain
        opt = ZeroRedundancyOptimizer(params, optimizer_class=cls, **defaults)
        parts = opt._partition_parameters()
        self.loads = [sum(p.numel() * p.element_size() for g in groups for p in g["params"]) for groups in parts]
        self.facts["optimizer_partition_bytes"] = self.loads
        return opt

    def rank_groups(self) -> list[RankGroup]:
        if not self.loads:
            return super().rank_groups()
        hi = max(range(len(self.loads)), key=lambda r: (self.loads[r], -r))
        lo = min(range(len(self.loads)), key=lambda r: (self.loads[r], r))
        if self.loads[hi] == self.loads[lo]:
            return [RankGroup(0, tuple(range(self.world_size)), "every rank updates the same number of parameter bytes")]
        rest = tuple(r for r in range(self.world_size) if r not in (hi, lo))
        groups = [RankGroup(hi, (hi,) + tuple(r for r in rest if self.loads[r] == self.loads[hi]), "the largest optimizer partition"),
                  RankGroup(lo, (lo,) + tuple(r for r in rest if self.loads[r] == self.loads[lo]), "the smallest optimizer partition")]
        if self.loads[lo] < self.loads[0] < self.loads[hi]:
            # rank 0 is simulated first in every estimate (memlens.estimator.ranks): reported as itself, not bounded by
            # the two others - its partition's tensors differ from theirs (greedy by size: the largest parameter, a
            # tied embedding, lands on it), and so may its segments (ZeRO-1 GPT-2 medium over 4 H200s: rank 0 held
            # rank 3's bytes within 4 KiB and 198 MiB more reserved than either; bench/results/zero1_probe.md)
            groups.append(RankGroup(0, (0,) + tuple(r for r in rest if r and self.loads[r] == self.loads[0]),
                                    "rank 0 (an optimizer partition between the largest and the smallest)"))
        between = tuple(r for r in rest if self.loads[lo] < self.loads[r] < self.loads[hi] and self.loads[r] != self.loads[0])
        if between:
            groups.append(RankGroup(-1, between, "between the two simulated ranks (partitions between theirs)"))
        return groups
