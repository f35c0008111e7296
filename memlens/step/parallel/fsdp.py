"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for one rank: zero2, zero3 and fsdp.

Wrapping (the recipe of torchtitan and of accelerate's FSDP2 plugin): ``fully_shard`` on every
transformer block (the classes in the Hugging Face model's ``_no_split_modules``; for other
models, the elements of its largest ``nn.ModuleList``), then on the root module. LoRA and
gradient checkpointing are applied before sharding. The model is built with its parameters on
the meta device, sharded, then materialized (``to_empty``) - on a device with random values, on
fake CPU tensors for an estimate - so no rank ever holds the full model.

What moves the peak is FSDP2's own code, which a simulated rank runs as is on fake tensors under
a fake process group (torch/distributed/fsdp/_fully_shard/, torch 2.x):

- each parameter is sharded on dim 0 and padded: every rank holds ceil(dim0 / N) rows
  (``_init_sharded_param``), the optimizer states only its unpadded rows;
- unshard (``foreach_all_gather``, on the all-gather *copy-in* stream): with a
  MixedPrecisionPolicy the shards are first cast into one flat param-dtype buffer, then one flat
  all-gather output of N x the group's padded shards; ``foreach_all_gather_copy_out`` (default
  stream) allocates each unsharded parameter and copies into it. In forward the flat output is
  freed only when the next group has copied out (implicit prefetching); in backward at once;
- reshard: unsharded parameters are freed by resizing their storage to 0 (``free_storage``),
  which no dispatch mode sees: :func:`track_storage_resizes` logs those frees and re-allocations;
- backward: a group's ``pre_backward`` also unshards the group that ran before it in forward
  (``_backward_prefetch``); ``post_backward`` copies the unsharded gradients into one flat
  reduce-scatter input (default stream, in ``reduce_dtype``) and allocates the reduce-scatter
  output on the reduce-scatter stream, whose views become the sharded ``.grad``; the input is
  kept until the next group's post_backward (one buffer in flight);
- ``reshard_after_forward``: True re-gathers every block in backward; False (zero2) keeps them
  gathered from forward to backward; the root never reshards after forward;
- streams: the caching allocator keeps a pool per stream, so the copy-in and reduce-scatter
  streams cache their own blocks (:class:`memlens.core.ledger.CachingAllocatorModel`).
"""
from __future__ import annotations

import contextlib
import importlib
import math

from ...core.enums import Category
from ...core.errors import SpecError
from ...core.parallel import sharding_of
from ...core.spec import TrainingSpec
from ..fake import materialize_on_fake
from ..optim import make_optimizer
from .base import RankGroup, Streams, Wrapper

_FSDP = "torch.distributed.fsdp._fully_shard"


def find_blocks(model) -> list:
    """The modules FSDP2 wraps one by one: the Hugging Face model's ``_no_split_modules`` classes,
    else the elements of its largest ``nn.ModuleList`` (a model without one is wrapped whole).
    A module whose parameter is tied to one outside it (BERT's word embeddings and its MLM decoder)
    stays with the root, as FSDP2 requires tied parameters in one group."""
    import torch  # heavy: torch, loaded on first use

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or ())
    blocks: list = []
    if names:
        blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
        if lists:
            biggest = max(lists, key=lambda ml: sum(p.numel() for p in ml.parameters()))
            blocks = [m for m in biggest if any(True for _ in m.parameters())]
    # no block inside another block (FSDP2 nests fine, but one level is the recipe), none with a tied parameter
    owners: dict[int, set[int]] = {}
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(id(mod))
    keep = []
    for b in blocks:
        inside = {id(m) for m in b.modules()}
        if any(owners.get(id(p), set()) - inside for p in b.parameters()):
            continue
        if any(b is not o and any(b is m for m in o.modules()) for o in blocks):
            continue
        keep.append(b)
    return keep


def mixed_precision(spec: TrainingSpec):
    """FSDP2's MixedPrecisionPolicy for a spec's precision (amp-bf16: bf16 compute, fp32 reduce)."""
    import torch  # heavy: torch, loaded on first use
    from torch.distributed.fsdp import MixedPrecisionPolicy  # heavy: torch, loaded on first use

    if spec.precision == "amp-bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def reshard_after_forward(spec: TrainingSpec) -> bool | int:
    if spec.reshard_after_forward is not None:
        return spec.reshard_after_forward
    return sharding_of(spec).reshard_after_forward


def local_rows(dim0: int, world_size: int, rank: int) -> int:
    """Rows of a dim-0 shard on ``rank`` (torch.chunk: ceil(dim0 / N) rows, the last ones fewer or none).

    >>> [local_rows(10, 4, r) for r in range(4)], [local_rows(2, 4, r) for r in range(4)]
    ([3, 3, 3, 1], [1, 1, 0, 0])
    """
    c = math.ceil(dim0 / world_size) if dim0 else 0
    return max(0, min(c, dim0 - rank * c))


class FSDPWrapper(Wrapper):
    """FSDP2 ``fully_shard`` per block + root (see the module docstring)."""

    name = "fsdp"
    builds_on_meta = True

    def __init__(self, spec: TrainingSpec, **kw):
        super().__init__(spec, **kw)
        self.raf = reshard_after_forward(spec)
        self.autocast = spec.precision != "amp-bf16"     # MixedPrecisionPolicy instead of autocast
        self.dim0s: list[tuple[int, int]] = []       # (dim 0, bytes per row) of each trainable parameter
        self.streams = Streams()
        self.unsharded_keys: set[int] = set()
        self.unsharded_grad_keys: set[int] = set()
        self.model = None
        mp = "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)" if spec.precision == "amp-bf16" else "no MixedPrecisionPolicy"
        self.settings = f"(reshard_after_forward={self.raf}, {mp})"      # HSDP and TP name their mesh before these
        self.applied.append(f"FSDP2 fully_shard over {self.world_size} GPUs per block + root {self.settings}")

    def build_context(self):
        """Real device: parameters on the meta device, buffers real (accelerate's init_empty_weights)."""
        try:
            from accelerate import init_empty_weights  # heavy: accelerate, loaded on first use
        except ImportError:

            raise SpecError("running FSDP2 on a device builds each rank's model with accelerate's init_empty_weights, "
                            "and accelerate (which peft installs) is missing", hint="pip install accelerate") from None
        return init_empty_weights(include_buffers=False)

    def wrap(self, model, *, device, fake_mode=None):
        import torch  # heavy: torch, loaded on first use

        mp = mixed_precision(self.spec)
        try:
            mesh = self.make_mesh(device.type)
            model = self.before_shard(model)
            for p in model.parameters():
                if p.requires_grad:
                    t = getattr(p, "_local_tensor", p)       # a tensor-parallel shard: FSDP2 shards its local rows
                    rowbytes = (t.numel() // t.shape[0]) * t.element_size() if t.dim() and t.shape[0] else t.element_size()
                    self.dim0s.append((t.shape[0] if t.dim() else 1, rowbytes))
            blocks = self.shard(model, mesh, mp)
        except (ValueError, NotImplementedError, AssertionError, RuntimeError) as e:

            msg = (str(e).splitlines() or [type(e).__name__])[0][:200]
            raise SpecError(f"FSDP2 fully_shard refuses this model: {msg}", hint="use --sharding ddp or zero1") from None
        self.facts.update(blocks=len(blocks), block_class=type(blocks[0]).__name__ if blocks else None,
                          reshard_after_forward=self.raf, mixed_precision=self.spec.precision == "amp-bf16")
        if self.fake:
            allow = fake_mode.allow_non_fake_inputs
            fake_mode.allow_non_fake_inputs = True      # to_empty reads the meta shards' shapes
            try:
                with fake_mode:
                    model.to_empty(device="cpu")
            finally:
                fake_mode.allow_non_fake_inputs = allow
            model = materialize_on_fake(model, fake_mode)
            _shards_already_padded(model)
        else:
            saved = {n: b.detach().clone() for n, b in model.named_buffers()}
            model.to_empty(device=device)
            with torch.no_grad():
                for n, b in model.named_buffers():
                    if n in saved:
                        b.copy_(saved[n])
                _init_values(model)
            del saved
        self.model = model
        return model

    shard_size: int | None = None        # ranks a parameter is sharded over (None: every rank; HSDP: its shard group)

    def make_mesh(self, device_type: str):
        """The DeviceMesh FSDP2 shards over: 1D over every rank (HSDP and TP build their own)."""
        from torch.distributed.device_mesh import init_device_mesh  # heavy: torch, loaded on first use

        return init_device_mesh(device_type, (self.world_size,))

    def before_shard(self, model):
        """What runs on the meta model before fully_shard (tensor parallel's parallelize_module)."""
        return model

    def shard_index(self, rank: int) -> int:
        """``rank``'s place in its shard group (which rows of every parameter it holds)."""
        return rank

    def shard(self, model, mesh, mp) -> list:
        """``fully_shard`` on every block, then the root; returns the blocks."""
        from torch.distributed.fsdp import fully_shard  # heavy: torch, loaded on first use

        blocks = find_blocks(model)
        for b in blocks:
            fully_shard(b, mesh=mesh, mp_policy=mp, reshard_after_forward=self.raf)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        return blocks

    def make_optimizer(self, spec: TrainingSpec, model, simulate: bool):
        """On a device: the spec's optimizer over the sharded DTensor parameters (as FSDP2 users do).
        Simulated: the same optimizer over each parameter's local shard. A DTensor optimizer step
        runs the same foreach kernels on the local shards (states of the local shape, temporaries
        alike), so the memory is the same, and the simulation skips DTensor's per-op sharding
        propagation (a third of the simulated step for an 8B model)."""
        if not simulate:
            return make_optimizer(spec, model, simulate=False)
        import torch  # heavy: torch, loaded on first use

        sharded = [p for p in model.parameters() if p.requires_grad]
        local = [torch.nn.Parameter(p._local_tensor, requires_grad=True) for p in sharded]
        holder = torch.nn.Module()
        holder.params = torch.nn.ParameterList(local)
        opt = make_optimizer(spec, holder, simulate=True)
        for p, q in zip(sharded, local):
            p.register_post_accumulate_grad_hook(lambda p, q=q: setattr(q, "grad", p.grad._local_tensor))
        plain_zero_grad = opt.zero_grad

        def zero_grad(set_to_none: bool = True) -> None:
            plain_zero_grad(set_to_none)
            for p in sharded:
                p.grad = None

        opt.zero_grad = zero_grad
        return opt

    def rank_groups(self) -> list[RankGroup]:
        n = self.world_size
        s = self.shard_size or n
        sig = [tuple(local_rows(d, s, self.shard_index(r)) for d, _ in self.dim0s) for r in range(n)]
        first, last = sig[0], sig[n - 1]
        if first == last:
            return [RankGroup(0, tuple(range(n)), "every rank holds equal shards (every dim 0 divides evenly)")]
        g0 = tuple(r for r in range(n) if sig[r] == first)
        gl = tuple(r for r in range(n) if sig[r] == last)
        groups = [RankGroup(0, g0, "the largest shards (torch.chunk gives the first ranks ceil(dim0/N) rows)"),
                  RankGroup(n - 1, gl, "the smallest shards (the last rows, or none)")]
        between = tuple(r for r in range(n) if r not in g0 and r not in gl)
        if between:
            groups.append(RankGroup(-1, between, "between the two simulated ranks: every shard between theirs"))
        return groups

    @contextlib.contextmanager
    def simulation(self, tracker, step):
        """Inside the tracker: FSDP2's unshard, copy-out and post-backward allocate "communication"
        charged to their group's module, storage resizes become frees and allocations, gathered
        gradients are tagged, and every allocation carries its CUDA stream."""
        pg = importlib.import_module(f"{_FSDP}._fsdp_param_group")
        fp = importlib.import_module(f"{_FSDP}._fsdp_param")
        group_cls = pg.FSDPParamGroup
        saved = [(fp, "alloc_storage", fp.alloc_storage), (fp, "free_storage", fp.free_storage),
                 (pg, "alloc_storage", pg.alloc_storage)] + \
                [(group_cls, m, getattr(group_cls, m)) for m in ("unshard", "wait_for_unshard", "post_backward")]
        streams = self.streams
        streams.namer = self._stream_name
        labels: dict[int, int] = {}

        def in_group(fn, retag_grads=False):
            def run(group, *a, **k):
                mid = labels.get(id(group))
                if mid is None:
                    mid = labels[id(group)] = tracker.log.module_id(tracker.module_label(group._module_fqn or ""))
                if retag_grads:
                    self._tag_gathered_grads(tracker, group)
                old = tracker.category_default, tracker.module
                tracker.category_default, tracker.module = Category.COMMUNICATION, mid
                try:
                    return fn(group, *a, **k)
                finally:
                    tracker.category_default, tracker.module = old
            return run

        alloc, free = track_storage_resizes(tracker, fp.alloc_storage, fp.free_storage, self.unsharded_keys, streams.current)
        fp.alloc_storage = pg.alloc_storage = alloc
        fp.free_storage = free
        group_cls.unshard = in_group(group_cls.unshard)
        group_cls.wait_for_unshard = in_group(group_cls.wait_for_unshard)
        group_cls.post_backward = in_group(group_cls.post_backward, retag_grads=True)
        tracker.stream_of = streams.current
        try:
            yield
        finally:
            for obj, name, v in saved:
                setattr(obj, name, v)
            tracker.stream_of = None
            self.facts["streams"] = {str(k): v for k, v in sorted(streams.names.items())}

    def _tag_gathered_grads(self, tracker, group) -> None:
        """The gradients autograd left on the gathered parameters (reduced and freed next)."""
        for fsdp_param in group.fsdp_params:
            g = getattr(getattr(fsdp_param, "_unsharded_param", None), "grad", None)
            if g is not None:
                tracker.retag(g, Category.GRADIENTS)
                k = tracker.key_of(g)
                if k is not None:
                    self.unsharded_grad_keys.add(k)

    def _stream_name(self, stream) -> str | None:
        state = self.model._get_fsdp_state() if self.model is not None and hasattr(self.model, "_get_fsdp_state") else None
        ctx = getattr(state, "_comm_ctx", None)
        for attr in ("all_gather_copy_in_stream", "all_gather_stream", "reduce_scatter_stream", "all_reduce_stream"):
            if getattr(ctx, attr, None) is stream:
                return attr.replace("_stream", "")
        return None


def track_storage_resizes(tracker, alloc_storage, free_storage, keys: set, stream_of):
    """FSDP2's ``alloc_storage`` / ``free_storage`` with ledger events: a storage resized to 0 is a
    free, resized back up a new allocation (charged to "parameters": they hold unsharded
    parameters). ``keys`` collects the ledger keys of those allocations."""

    def alloc(tensor) -> None:
        st = tensor.untyped_storage()
        was = st.nbytes()
        alloc_storage(tensor)
        if was == 0 and st.nbytes() > 0:
            key = tracker.regrown(st, Category.PARAMETERS, "fsdp.alloc_storage", stream=stream_of())
        else:
            key = tracker.storage_key(st)
            if key is not None:
                tracker.retag(tensor, Category.PARAMETERS)
        if key is not None:
            keys.add(key)

    def free(tensor) -> None:
        st = tensor.untyped_storage()
        if st.nbytes() > 0:
            tracker.shrunk(st)
        free_storage(tensor)

    return alloc, free


def _shards_already_padded(model) -> None:
    """``to_empty`` re-padded every local shard (``reset_sharded_param``), so lazy init has nothing
    to redo. On a device lazy init sees that by comparing data pointers; fake tensors have none,
    and FSDP2 would pad the uneven shards a second time, in the first forward."""
    from torch.distributed.fsdp import FSDPModule  # heavy: torch, loaded on first use

    for m in model.modules():
        if isinstance(m, FSDPModule):
            for g in _param_groups(m._get_fsdp_state()):
                g._reset_sharded_params = True


def _param_groups(state) -> list:
    """An FSDP state's parameter groups: a list from torch 2.13, one group (or None) before."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        g = getattr(state, "_fsdp_param_group", None)
        groups = [g] if g is not None else []
    return list(groups)


def _init_values(model) -> None:
    """Random values for sharded parameters on a device (memory does not depend on them): N(0, 0.02)
    for matrices, 1 for norm weights, 0 for other vectors; written into each local shard."""
    for name, p in model.named_parameters():
        t = getattr(p, "_local_tensor", p)
        if p.dim() >= 2:
            t.normal_(0.0, 0.02)
        elif "norm" in name or name.split(".")[-2:-1] in (["ln_1"], ["ln_2"], ["ln_f"]):
            t.fill_(1.0)
        else:
            t.zero_()


__all__ = ["FSDPWrapper", "find_blocks", "mixed_precision", "local_rows", "track_storage_resizes"]


@contextlib.contextmanager
def default_mesh(mesh):
    """``fully_shard`` called without a mesh (Opacus' FSDP2Wrapper) takes ``mesh``: its default is a mesh on the
    machine's accelerator (``torch._C._get_accelerator()``), CUDA on a GPU machine even while the simulation shards
    fake CPU tensors (``Unhandled FakeTensor Device Propagation ... cpu, cuda:0``)."""
    mod = importlib.import_module("torch.distributed.fsdp._fully_shard._fully_shard")
    names = [n for n in ("_init_default_mesh", "_init_default_fully_shard_mesh") if hasattr(mod, n)]
    saved = {n: getattr(mod, n) for n in names}
    try:
        for n in names:
            setattr(mod, n, lambda *a, **k: mesh)
        yield
    finally:
        for n, f in saved.items():
            setattr(mod, n, f)
