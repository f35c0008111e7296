"""The fake-tensor mode of memlens' simulations: torch's FakeTensorMode with a cheaper key for its dispatch cache.

FakeTensorMode caches each op's output metadata under a key made of the op and its arguments, a fake tensor's part
of it being its whole :func:`torch._subclasses.fake_tensor.extract_tensor_metadata` flattened field by field (the
sparse-layout checks, the suggested memory format and its contiguity, a dataclass walk: tens of microseconds of
Python a tensor). A simulation hits that cache on about nine ops in ten (a model's layers repeat), so the key was
much of a hit's time: this key takes 11.7% off a whole estimate's CPU (bench/results/sim_speed.md). For a plain fake tensor of this mode (strided, no symbolic sizes, no constant value, not quantized) the
same metadata is a function of fewer reads, which go into the key as one tuple: dtype, shape, stride, device,
storage offset, storage bytes, requires_grad and the conjugate / negative / inference bits (the memory format is a
function of shape and stride, the sparse fields are empty for a strided tensor). Anything else (nested lists,
symbolic values, other tensors, callables) takes torch's own path. Two arguments that torch's key tells apart, this
key tells apart: the outputs built from the cache are the ones torch builds.
"""
from __future__ import annotations

import inspect

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

_TENSOR = object()      # marks a tensor's entry in a key: no key of torch's own path holds it
_PLAIN = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format})


class SimulationFakeMode(FakeTensorMode):
    """FakeTensorMode whose dispatch-cache key reads a plain fake tensor's metadata directly (module docstring)."""

    def _prep_args_for_hash(self, result, args, state, id_hashed_objects) -> None:
        if type(args) not in (list, tuple):
            return super()._prep_args_for_hash(result, args, state, id_hashed_objects)
        result.append(type(args))
        result.append(len(args))
        for arg in args:
            t = type(arg)
            if t is FakeTensor:
                if (arg.fake_mode is self and arg.constant is None and arg.layout is torch.strided
                        and not arg._has_symbolic_sizes_strides and not arg.is_quantized):
                    result.append((_TENSOR, arg.dtype, tuple(arg.shape), arg.stride(), arg.device, arg.storage_offset(),
                                   arg.untyped_storage().nbytes(), arg.requires_grad, arg.is_conj(), arg.is_neg(),
                                   arg.is_inference()))
                    continue
            elif t in _PLAIN:
                result.append(t)
                result.append(arg)
                continue
            super()._prep_args_for_hash(result, (arg,), state, id_hashed_objects)


# torch's private method, as this override reads it (torch 2.11-2.13): a torch whose method takes other parameters
# gets torch's own mode (the simulation is the same, only slower)
_EXPECTED = ["self", "result", "args", "state", "id_hashed_objects"]


def simulation_fake_mode(**kwargs) -> FakeTensorMode:
    """The simulation's fake mode: :class:`SimulationFakeMode` where torch's dispatch cache is as it expects."""
    method = getattr(FakeTensorMode, "_prep_args_for_hash", None)
    try:
        ok = method is not None and list(inspect.signature(method).parameters) == _EXPECTED
    except (TypeError, ValueError):
        ok = False
    return (SimulationFakeMode if ok else FakeTensorMode)(**kwargs)
