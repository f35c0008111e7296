"""``--compile``: the ``torch.compile``'d step, simulated with the compiler's own partitioner.

What decides a compiled step's memory is which activations the compiled backward keeps.
``torch.compile`` (inductor) traces the model's forward and backward into one joint graph
(AOTAutograd), applies inductor's decompositions, and splits it with the min-cut
rematerialization partitioner (``torch._functorch.partitioners.min_cut_rematerialization_partition``,
``compiler="inductor"``): the forward graph returns exactly the tensors the backward graph
needs; everything cheap to recompute is recomputed in backward instead of kept.

This module runs that same machinery on the fake tensors of the simulation:
:func:`compile_for_simulation` traces the model's forward under the CUDA emulation (so the
attention kernels and autocast policy are CUDA's), partitions it with inductor's partitioner,
and returns a module whose forward runs the partitioned forward graph and whose backward runs
the partitioned backward graph, op by op, under the storage tracker. The saved activations are
therefore the compiled step's own.

What is bounded rather than exact: inductor fuses each graph into Triton kernels that do not
materialize most intermediates, while this runs the graphs op by op (each intermediate freed at
its last use). The transient buffers inside a graph are therefore an upper bound on the
generated kernels' buffers, and the estimate is an upper bound on the compiled step's peak
(the saved activations, which dominate, are exact). Inductor's pattern rewrites before
partitioning (joint-graph passes) are not applied. Dynamo's graph capture is replaced by a
trace of the whole forward (``torch.func.functional_call``): a model that dynamo would split at
graph breaks is partitioned as one graph here. bench/gpu_generality_calibrate.py measures the
gap on shapes outside the accuracy set; bench/results/generality_accuracy.md reports it.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

BOUND = ("upper bound: saved activations from inductor's min-cut partitioner (exact), graph intermediates "
         "run op by op (at least inductor's fused buffers)")


class CompiledForSimulation(torch.nn.Module):
    """A model whose forward runs an AOTAutograd-partitioned graph (forward and backward)."""

    def __init__(self, model: torch.nn.Module, fn: Callable, params: dict, out_spec, constants: list, keys: tuple[str, ...]):
        super().__init__()
        self.model = model
        self._fn = fn
        self._params = params
        self._out_spec = out_spec
        self._constants = constants
        self._keys = keys

    def forward(self, **kwargs):
        from torch.utils._pytree import tree_unflatten

        outs = self._fn(self._params, *[kwargs[k] for k in self._keys])
        it = iter(outs)
        leaves = [next(it) if c is _TENSOR else c for c in self._constants]
        return tree_unflatten(leaves, self._out_spec)


_TENSOR = object()   # placeholder for a tensor leaf of the model's output


def compile_for_simulation(model, batch: dict, forward_keys, trace_context: Callable[[], Any]) -> CompiledForSimulation:
    """Trace ``model(**batch)`` and its backward with AOTAutograd, partition the joint graph with
    inductor's min-cut partitioner, and return the module that runs the two graphs.

    ``trace_context``: the contexts the forward runs in during the simulated step (fake mode,
    CUDA emulation, autocast): the trace happens under them, outside the storage tracker.
    """
    from functools import partial

    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table
    from torch.utils._pytree import tree_flatten

    from ..core.errors import MemlensError

    if not isinstance(batch, dict):
        raise MemlensError("--compile needs a dict batch (keyword inputs)", hint="return a dict batch from the factory")
    keys = tuple(k for k in batch if (forward_keys is None or k in forward_keys) and isinstance(batch[k], torch.Tensor))
    extra = {k: v for k, v in batch.items() if k not in keys and (forward_keys is None or k in forward_keys)}
    params = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    structure: dict[str, Any] = {}

    def f(p, *inputs):
        out = torch.func.functional_call(model, p, (), {**dict(zip(keys, inputs)), **extra}, tie_weights=True)
        leaves, spec = tree_flatten(out)
        structure["spec"] = spec
        structure["constants"] = [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]
        return tuple(x for x in leaves if isinstance(x, torch.Tensor))

    def keep(gm, example_inputs):
        # boxed calling convention, as inductor's generated `call(args)` has: the graph takes its
        # inputs as one list and clears it, so each saved activation is freed at its last use in
        # backward instead of living until the backward graph returns
        gm.graph.set_codegen(torch.fx.graph._BoxedCodeGen())
        gm.recompile()

        def run(args):
            return gm(args)

        run._boxed_call = True
        return run

    fn = aot_function(f, fw_compiler=keep, bw_compiler=keep, decompositions=select_decomp_table(),
                      partition_fn=partial(min_cut_rematerialization_partition, compiler="inductor"))
    with trace_context():
        outs = fn(params, *[batch[k] for k in keys])   # traces and partitions (the outputs are dropped)
    del outs
    return CompiledForSimulation(model, fn, params, structure["spec"], structure["constants"], keys)


@contextlib.contextmanager
def no_context():
    yield
