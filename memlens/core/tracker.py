"""Track every tensor storage of a step as ledger events (used on fake and on real CPU tensors).

A TorchDispatchMode sees each op's outputs; a new storage becomes an ``alloc`` event and a
``weakref.finalize`` on it emits the ``free``. The tracker holds no strong reference to any
tensor, so autograd's buffer stealing and freeing work as they do without it.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .events import EventLog

_ITEM = torch.ops.aten._local_scalar_dense.default


def _wait_tensor():
    """``_c10d_functional.wait_tensor`` (None where torch.distributed is not built)."""
    try:
        return torch.ops._c10d_functional.wait_tensor.default
    except (AttributeError, RuntimeError):
        return None


# torch.distributed's functional collectives: on CUDA ``wait_tensor`` waits for the collective and returns its input
# (torch/csrc/distributed/c10d/Functional.cpp), but its Meta kernel, which fake tensors run, returns
# ``torch.empty_like(input)`` (torch/distributed/_functional_collectives.py): a second storage the size of the gathered
# tensor that the GPU never allocates (TP's all-gathered logits: one more segment of their size in the reserved peak)
_WAIT_TENSOR = _wait_tensor()


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor  # heavy: torch, loaded on first use

    return isinstance(_local(t), FakeTensor)


def _local(t):
    """The tensor that owns the memory: a DTensor's local shard (FSDP2 parameters, gradients and
    optimizer states are DTensors whose storage is their ``_local_tensor``'s), else ``t``."""
    return t if type(t) is torch.Tensor else getattr(t, "_local_tensor", t)


from .enums import INPUTS_LABEL, OPTIMIZER_LABEL, OUTSIDE_LABEL, ROOT_LABEL, Category  # noqa: F401 - labels used by callers


class StorageTracker(TorchDispatchMode):
    """Turns storages created by ops into EventLog events, with category, module and phase."""

    def __init__(self, log: EventLog, device_type: str | None = None):
        super().__init__()
        self.log = log
        self.device_type = device_type       # account only storages on this device (None: all)
        self._refs: dict[int, Any] = {}      # key -> weakref whose callback logs the free
        self.phase = "setup"
        self.step = 0
        self.category_default = Category.TEMPORARIES
        self.module = -1                     # module id allocations are charged to
        self._keys: dict[int, int] = {}      # id(storage) -> key
        self._category: dict[int, str] = {}  # key -> current category
        self._next = 0
        self.stream_of: Any = None           # () -> CUDA stream id of the next allocation (None: always 0)
        self.muted = False                   # True: ops run unaccounted (stand-ins for storages already logged)
        self.output_order: dict = {}         # op -> the order its outputs are allocated in, where not as returned
        self._host: dict[int, Any] = {}      # id(storage) -> storage: on the host in the real run, never logged (on_host)

    # ---------------------------------------------------------------- registration
    @staticmethod
    def module_label(name: str) -> str:
        """Module name without Opacus' (``_module``) and peft's wrapper prefixes; the root is the
        loss and glue code."""
        parts = name.split(".") if name else []
        while parts[:1] == ["_module"] or parts[:2] == ["base_model", "model"]:
            parts = parts[1:] if parts[0] == "_module" else parts[2:]
        return ".".join(parts) if parts else ROOT_LABEL

    def register(self, t: torch.Tensor, category: str, module: str | None = None, op: str = "") -> int | None:
        """Account a tensor created outside the mode (parameters, inputs). Returns its key."""
        t = _local(t)
        if self.device_type is not None and t.device.type != self.device_type:
            return None
        st = t.untyped_storage()
        sid = id(st)
        if sid in self._keys:
            return self._keys[sid]
        nbytes = st.nbytes()
        if nbytes == 0:
            return None
        key = self._new_key(st, sid)
        mid = self.log.module_id(module) if module is not None else self.module
        self._category[key] = category
        self.log.alloc(key, nbytes, category, mid, self.phase, op)
        return key

    def _new_key(self, st, sid: int) -> int:
        key = self._next
        self._next += 1
        self._keys[sid] = key
        # a plain weakref callback is cheaper than weakref.finalize on every op of a real step
        self._refs[key] = weakref.ref(st, lambda _r, sid=sid, key=key: self._on_free(sid, key))
        return key

    def _on_free(self, sid: int, key: int) -> None:
        self._refs.pop(key, None)
        if self._keys.get(sid) == key:
            del self._keys[sid]
        self._category.pop(key, None)
        self.log.free(key)

    def new_key(self) -> int:
        """A fresh key for a storage logged by hand (its tensor is adopted later, see :meth:`adopt`)."""
        key = self._next
        self._next += 1
        return key

    def adopt(self, t: torch.Tensor, key: int, category: str) -> None:
        """Account ``t``'s storage under ``key``, already logged as allocated: no event now, the free when it dies."""
        st = t.untyped_storage()
        sid = id(st)
        self._keys[sid] = key
        self._refs[key] = weakref.ref(st, lambda _r, sid=sid, key=key: self._on_free(sid, key))
        self._category[key] = category

    def disown(self, key: int) -> None:
        """Stop accounting the storage of ``key`` without logging its free (that free is written by hand)."""
        ref = self._refs.pop(key, None)
        st = ref() if ref is not None else None
        if st is not None and self._keys.get(id(st)) == key:
            del self._keys[id(st)]
        self._category.pop(key, None)

    def key_of(self, t: torch.Tensor) -> int | None:
        return self._keys.get(id(_local(t).untyped_storage()))

    def category_of(self, key: int, default: str | None = None) -> str | None:
        """The category the storage ``key`` has now (``default`` if it is not accounted any more)."""
        return self._category.get(key, default)

    def storage_of(self, key: int):
        """The live storage accounted under ``key``, or None (gone, or never this tracker's)."""
        ref = self._refs.get(key)
        return ref() if ref is not None else None

    # ---------------------------------------------------------------- storages resized in place (FSDP2)
    def regrown(self, st, category: str, op: Any, stream: int = 0) -> int:
        """A storage resized back up from 0 bytes: a new allocation under a new key, logged now."""
        key = self._new_key(st, id(st))
        self._category[key] = category
        self.log.alloc(key, st.nbytes(), category, self.module, self.phase, op, stream=stream)
        return key

    def storage_key(self, st) -> int | None:
        """The key ``st`` (a storage, not a tensor) is accounted under, or None."""
        return self._keys.get(id(st))

    def shrunk(self, st) -> None:
        """A storage about to be resized to 0 bytes: its free, logged now (once; its key is kept for a regrowth)."""
        key = self._keys.get(id(st))
        if key is not None and self._category.pop(key, None) is not None:
            self.log.free(key)

    def retag(self, t: torch.Tensor, category: str, only_from: tuple[str, ...] | None = None) -> None:
        key = self.key_of(t)
        if key is None:
            return
        cur = self._category.get(key)
        if cur == category or (only_from is not None and cur not in only_from):
            return
        self._category[key] = category
        self.log.tag(key, category)

    def on_host(self, tensors) -> None:
        """Storages that the real run keeps on the host (DP-SGD's dataset, the logical batch its data loader
        gathers physical batches from): never logged, whatever op first shows them to the mode."""
        for t in tensors:
            st = _local(t).untyped_storage()
            if id(st) not in self._keys:
                self._host[id(st)] = st

    def release(self, t: torch.Tensor) -> None:
        """Stop accounting a storage that lives off the device (e.g. optimizer step counters)."""
        key = self.key_of(t)
        if key is not None and key in self._category:
            self._category[key] = "host"
            self.log.free(key)

    @contextlib.contextmanager
    def scope(self, category: str):
        """Storages created inside get ``category`` (e.g. Opacus' per-sample gradients while its
        grad sampler runs)."""
        old = self.category_default
        self.category_default = category
        try:
            yield
        finally:
            self.category_default = old

    def set_phase(self, name: str, step: int) -> None:
        self.phase, self.step = name, step
        self.log.phase(name, step)

    def resume(self, name: str, step: int) -> None:
        """Go on in phase ``name`` of step ``step`` without logging its mark (its events were written by hand)."""
        self.phase, self.step = name, step

    # ---------------------------------------------------------------- the mode
    def _dispatch(self, func, types, args=(), kwargs=None):
        if self.muted:
            return func(*args, **(kwargs or {}))
        if func is _ITEM and self.phase == "optimizer" and _is_fake(args[0]):
            # an optimizer reading a value (Adafactor's parameter RMS) only scales its update:
            # any number gives the same allocations, and a fake tensor has none to give
            return 1.0 if args[0].is_floating_point() else 1
        if func is _WAIT_TENSOR and _is_fake(args[0]):
            return args[0]
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            flat = (out,)
        elif type(out) in (tuple, list):
            flat = out
            order = self.output_order.get(func)
            if order is not None:
                flat = [out[i] for i in order]
        else:
            flat = tree_flatten(out)[0]
        dev = self.device_type
        for t in flat:
            if not isinstance(t, torch.Tensor):
                continue
            if type(t) is not torch.Tensor:
                t = _local(t)
            if dev is not None and t.device.type != dev:
                continue
            st = t.untyped_storage()
            sid = id(st)
            if sid in self._keys or sid in self._host:
                continue
            nbytes = st.nbytes()
            if nbytes == 0:
                continue
            key = self._new_key(st, sid)
            self._category[key] = self.category_default
            if self.stream_of is None:
                self.log.alloc(key, nbytes, self.category_default, self.module, self.phase, func)
            else:
                self.log.alloc(key, nbytes, self.category_default, self.module, self.phase, func, stream=self.stream_of())
        return out

    # torch wraps the __torch_dispatch__ of each mode class in a dynamo-disabling wrapper (TorchDispatchMode's
    # __init_subclass__); a subclass's own handler, already inside that wrapper, calls _dispatch unwrapped
    __torch_dispatch__ = _dispatch


def pack_hook_for(tracker: StorageTracker):
    """saved_tensors_hooks pack function: tensors autograd saves become 'activations'."""

    def pack(t: torch.Tensor) -> Any:
        tracker.retag(t, Category.ACTIVATIONS, only_from=(Category.TEMPORARIES,))
        return t

    return pack


def opacus_hooked(mod) -> bool:
    """Whether Opacus hooks ``mod`` for per-sample gradients: a full backward hook that is GradSampleModule's
    ``capture_backprops_hook`` (a partial of it). The step-time model prices those calls at calibrate's hooked-module
    costs; a user's own full backward hook is not Opacus' work and is not priced as it."""
    for h in mod._backward_hooks.values():
        f = getattr(h, "func", h)
        if (getattr(f, "__module__", None) or "").startswith("opacus"):
            return True
    return False


class ModuleScope:
    """Charge allocations to the module running: forward pre/post hooks keep a stack, and a
    pre-hook on each module output's grad_fn marks where backward enters that module.

    Hooks hold module names only (never tensors or graph nodes), so nothing is kept alive:
    torch's own ModuleTracker keeps multi-grad hooks that retain recomputed graphs.
    """

    def __init__(self, tracker: StorageTracker, model: torch.nn.Module):
        self.tracker = tracker
        self.ids = {id(m): tracker.log.module_id(tracker.module_label(n)) for n, m in model.named_modules()}
        self.outside = tracker.log.module_id(OUTSIDE_LABEL)
        self.stack: list[int] = []
        self._handles: list = []

    def _pre(self, mod, args):
        mid = self.ids.get(id(mod))
        if mid is not None:
            self.stack.append(mid)
            self.tracker.module = mid
            timer = getattr(self.tracker, "timer", None)    # the step-time pricing prices each module call's host cost
            if timer is not None:
                # a full backward hook (Opacus'): costs more, both ways; a module naming its own host work per call
                # (memlens_host_call: the 4-bit stand-in for bitsandbytes' Linear4bit) has it priced per call
                timer.module_call(opacus_hooked(mod), getattr(mod, "memlens_host_call", None))

    def _post(self, mod, args, out):
        mid = self.ids.get(id(mod))
        if mid is None:
            return
        if self.stack:
            self.stack.pop()
        self.tracker.module = self.stack[-1] if self.stack else self.outside
        if torch.is_grad_enabled():
            tracker = self.tracker
            hooked = opacus_hooked(mod)
            call = getattr(mod, "memlens_host_call", None)

            def enter(grad_outputs, mid=mid):
                tracker.module = mid
                timer = getattr(tracker, "timer", None)
                if timer is not None:
                    if hooked:
                        timer.hooked_backward()
                    if call:
                        timer.host_call_backward(call)

            seen = set()
            for t in (out,) if isinstance(out, torch.Tensor) else tree_flatten(out)[0]:
                fn = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None
                if fn is not None and id(fn) not in seen:
                    seen.add(id(fn))
                    fn.register_prehook(enter)

    def __enter__(self):
        from torch.nn.modules.module import (  # heavy: torch, loaded on first use
            register_module_forward_hook,
            register_module_forward_pre_hook,
        )

        self._handles = [register_module_forward_pre_hook(self._pre), register_module_forward_hook(self._post)]
        self.tracker.module = self.outside
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []
        self.tracker.module = self.outside


# ---------------------------------------------------------------- what a step holds before it runs
def register_model(tracker: StorageTracker, model, with_grads: bool = False) -> None:
    """Account a model's parameters (charged to the module that owns them; a quantized weight held as
    buffers, ``memlens_weight_buffers``, counts as parameters), buffers, and with
    ``with_grads`` the gradients they already hold (a profile started after the first step)."""
    names: dict[int, str] = {}
    for mname, mod in model.named_modules():
        for p in mod.parameters(recurse=False):
            names.setdefault(id(p), tracker.module_label(mname))
    for p in model.parameters():
        tracker.register(p, Category.PARAMETERS, names.get(id(p), ROOT_LABEL), op="model")
        if with_grads and p.grad is not None:
            tracker.register(p.grad, Category.GRADIENTS, names.get(id(p), ROOT_LABEL), op="grad")
    for mname, mod in model.named_modules():
        weights = getattr(mod, "memlens_weight_buffers", ())   # a quantized weight held as buffers (models.quant)
        for bname, b in mod.named_buffers(recurse=False):
            tracker.register(b, Category.PARAMETERS if bname in weights else Category.BUFFERS, tracker.module_label(mname), op="model")


def register_inputs(tracker: StorageTracker, batch: Any) -> None:
    """Account the batch's tensors as inputs (a tensor used twice, input_ids as labels, counts once)."""
    for t in tree_flatten(batch)[0]:
        if isinstance(t, torch.Tensor):
            if tracker.key_of(t) is None:
                tracker.register(t, Category.INPUTS, INPUTS_LABEL, op="batch")
            else:
                tracker.retag(t, Category.INPUTS, only_from=(Category.TEMPORARIES,))


def tag_optimizer_state(tracker: StorageTracker, optimizer, register: bool = False) -> None:
    """Tag the optimizer's state tensors (registering them when ``register``: a profile started
    after the first step). On fake tensors everything is on one device, so the per-parameter
    ``step`` counter is released unless the optimizer keeps it on the GPU (fused or capturable):
    torch keeps it on the CPU otherwise."""
    if type(optimizer).__name__ == "ZeroRedundancyOptimizer":
        optimizer = optimizer.optim    # ZeRO-1 keeps this rank's states in its local optimizer
    on_device = bool(getattr(optimizer, "_memlens_step_on_device", False)) or any(
        g.get("fused") or g.get("capturable") for g in getattr(optimizer, "param_groups", []))
    for state in optimizer.state.values():
        for k, t in state.items():
            if not isinstance(t, torch.Tensor):
                continue
            if k == "step" and t.numel() == 1 and _is_fake(t) and not on_device:
                tracker.release(t)
            elif register and tracker.key_of(t) is None:
                tracker.register(t, Category.OPTIMIZER_STATE, OPTIMIZER_LABEL, op="state")
            else:
                tracker.retag(t, Category.OPTIMIZER_STATE)
