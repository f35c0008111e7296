"""Tensor parallel (``--tp N``) composed with FSDP2 (or HSDP) for one rank: torchtitan's 2D (3D with HSDP).

The mesh is ``init_device_mesh(device, (dp, tp), mesh_dim_names=("dp_shard", "tp"))`` - with HSDP
``(replicate, shard, tp)`` - TP on the last (innermost: one node's NVLink) dim. On the meta model,
``torch.distributed.tensor.parallel.parallelize_module`` applies torchtitan's Llama plan
(torchtitan/models/llama3/infra/parallelize.py ``apply_tp``), written for Hugging Face's module names
(Llama, Mistral, Qwen2/3: the same projections):

- ``embed_tokens``: ``RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))`` (vocab-sharded
  table, reduce-scattered into sequence shards);
- every block: ``input_layernorm`` / ``post_attention_layernorm`` ``SequenceParallel()`` (norms on the
  sequence shard); ``self_attn`` / ``mlp`` ``PrepareModuleInput`` (all-gather the sequence: Shard(1) ->
  Replicate); ``q/k/v_proj``, ``gate/up_proj`` ``ColwiseParallel()`` (heads and the MLP width split N ways);
  ``o_proj`` / ``down_proj`` ``RowwiseParallel(output_layouts=Shard(1))`` (reduce-scatter back to the sequence shard);
- ``norm``: ``SequenceParallel()``; ``lm_head``: ``ColwiseParallel(input_layouts=Shard(1),
  output_layouts=Replicate())`` (the logits all-gathered whole), or with ``--loss-parallel`` (torchtitan's
  default with TP) ``output_layouts=Shard(-1), use_local_output=False``: the logits stay vocabulary-sharded and the
  model's cross-entropy runs on the shards under torch's ``loss_parallel()`` (entered around the simulated step; on
  a device, for the process), whose handlers all-reduce the max and the sum of the log-softmax across the TP group.

The residual stream stays a sequence-sharded DTensor between the blocks (torchtitan keeps the same
local tensors; the bytes are the same), so the embedding's output, the residual adds and the norms hold
L / N tokens per rank, the attention and MLP inputs the whole sequence. Then FSDP2 ``fully_shard`` runs on
the data-parallel sub-mesh per block + root as without TP, over the TP-local shards (2D DTensor
parameters ``(Shard(0), Shard(d))``). Every op - DTensor's sharding propagation and its collectives'
output buffers (all-gather, reduce-scatter, all-reduce of the partial norm-weight gradients) - runs as is
on fake tensors under the fake process group.

Refused: a model without those module names, heads or widths that do not divide by N (DTensor's uneven
shards break Hugging Face's ``view(..., -1, head_dim)``).
"""
from __future__ import annotations

import contextlib

from ...core.errors import SpecError
from .fsdp import FSDPWrapper

# torchtitan's plan, with Hugging Face's names (module path relative to a decoder layer / to the model)
COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")
SEQUENCE = ("input_layernorm", "post_attention_layernorm")


class TPWrapper(FSDPWrapper):
    """DTensor tensor parallel on the last mesh dim, FSDP2 (or HSDP) on the others (module docstring)."""

    name = "tp"

    def __init__(self, spec, **kw):
        super().__init__(spec, **kw)
        self.tp = spec.tp
        dp = self.world_size // self.tp
        self.hsdp = spec.sharding == "hsdp"
        self.shard_size = spec.shard_size if self.hsdp else dp
        self.replicas = dp // self.shard_size
        self.mesh = None
        dims = f"{self.replicas} x {self.shard_size} x {self.tp} (replicate x shard x tp)" if self.hsdp else f"{dp} x {self.tp} (dp_shard x tp)"
        self.applied[-1] = (f"DTensor tensor parallel over {self.tp} GPUs (torchtitan's Llama plan: colwise q/k/v/gate/up, rowwise "
                            f"o/down, sequence-parallel norms{', loss parallel' if spec.loss_parallel else ''}) + FSDP2 fully_shard per block + root over {self.shard_size} on a "
                            f"{dims} DeviceMesh {self.settings}")

    @property
    def strategy(self) -> str:
        return (f"FSDP2 x TP: tensor parallel over {self.tp} GPUs, FSDP2 over {self.shard_size}"
                + (f", replicated {self.replicas} times (HSDP)" if self.hsdp else ""))

    def make_mesh(self, device_type: str):
        from torch.distributed.device_mesh import init_device_mesh  # heavy: torch, loaded on first use

        fresh_dtensor_caches()
        if self.hsdp:
            self.mesh = init_device_mesh(device_type, (self.replicas, self.shard_size, self.tp), mesh_dim_names=("replicate", "shard", "tp"))
            self.facts.update(mesh={"replicate": self.replicas, "shard": self.shard_size, "tp": self.tp})
            return self.mesh["replicate", "shard"]
        self.mesh = init_device_mesh(device_type, (self.shard_size, self.tp), mesh_dim_names=("dp_shard", "tp"))
        self.facts.update(mesh={"dp_shard": self.shard_size, "tp": self.tp})
        return self.mesh["dp_shard"]

    def shard_index(self, rank: int) -> int:
        return (rank // self.tp) % self.shard_size

    def before_shard(self, model):
        """torchtitan's TP plan on the meta model (parallelize_module)."""
        from torch.distributed.tensor.parallel import parallelize_module  # heavy: torch, loaded on first use

        inner, layers = _decoder(model)
        _check_divisible(inner, self.tp)
        tied = model.lm_head.weight is inner.embed_tokens.weight
        tp_mesh = self.mesh["tp"]
        plan_top, plan_layer = tp_plan(loss_parallel=self.spec.loss_parallel)
        parallelize_module(model, tp_mesh, plan_top)
        for layer in layers:
            parallelize_module(layer, tp_mesh, plan_layer)
        if self.spec.loss_parallel and not self.fake:
            from torch.distributed.tensor.parallel import loss_parallel  # heavy: torch, loaded on first use

            self._loss_parallel = loss_parallel()
            self._loss_parallel.__enter__()     # for the rest of the process (torchrun's worker): every step's loss
        if tied:
            # parallelize_module gives each module its own DTensor parameter, which unties a tied lm_head; both are
            # vocab-sharded (Shard(0)), so the model is tied again as it trains (one weight, its gradient summed)
            model.lm_head.weight = inner.embed_tokens.weight
        self.facts.update(tp=self.tp, tp_layers=len(layers), tied_embeddings=tied)
        return model


    @contextlib.contextmanager
    def simulation(self, tracker, step):
        """FSDP2's simulation hooks, and torch's ``loss_parallel()`` around the step with ``--loss-parallel``."""
        with super().simulation(tracker, step), (_loss_parallel() if self.spec.loss_parallel else contextlib.nullcontext()):
            yield


def _loss_parallel():
    from torch.distributed.tensor.parallel import loss_parallel  # heavy: torch, loaded on first use

    return loss_parallel()


def fresh_dtensor_caches() -> None:
    """Forget DTensor's cached sharding decisions and redistribution plans. They are keyed by DeviceMesh, and two
    meshes are equal when their shape, rank map and dim names are (torch/distributed/device_mesh.py ``__eq__``),
    whatever process group they were built on: a second simulated rank in this process would be handed the first
    one's mesh, whose groups the fake process group destroyed with it."""
    import torch  # heavy: torch, loaded on first use
    from torch.distributed.tensor import DTensor  # heavy: torch, loaded on first use
    from torch.distributed.tensor import _redistribute  # heavy: torch, loaded on first use
    from torch.distributed.tensor._collective_utils import MeshTopoInfo  # heavy: torch, loaded on first use

    for clear in (getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None),      # the C++ dispatch fast path
                  DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear,
                  getattr(_redistribute, "clear_redistribute_planner_cache", None) or _redistribute._gen_transform_infos.cache_clear,
                  MeshTopoInfo.build_from_mesh.cache_clear):
        if clear is not None:
            clear()


def tp_plan(loss_parallel: bool = False) -> tuple[dict, dict]:
    """(the model's plan, a decoder layer's plan): torchtitan's apply_tp with Hugging Face's module names
    (``loss_parallel``: lm_head's output vocabulary-sharded, as torchtitan's default)."""
    from torch.distributed.tensor import Replicate, Shard  # heavy: torch, loaded on first use
    from torch.distributed.tensor.parallel import (  # heavy: torch, loaded on first use
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    top = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
           "model.norm": SequenceParallel(),
           "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False) if loss_parallel
           else ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    layer = {n: SequenceParallel() for n in SEQUENCE}
    layer["self_attn"] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()})
    layer["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    layer.update({n: ColwiseParallel() for n in COLWISE})
    layer.update({n: RowwiseParallel(output_layouts=Shard(1), use_local_output=False) for n in ROWWISE})
    return top, layer


def _decoder(model):
    """(the decoder, its layers) of a Llama-style causal LM, or one line saying why --tp cannot apply."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = getattr(base, "model", None)
    layers = getattr(inner, "layers", None)
    names = {n for n, _ in base.named_modules()}
    need = ["model.embed_tokens", "model.norm", "lm_head"] + [f"model.layers.0.{n}" for n in COLWISE + ROWWISE + SEQUENCE]
    missing = [n for n in need if n not in names]
    if layers is None or missing:
        raise SpecError(f"--tp applies torchtitan's Llama plan (embed_tokens, q/k/v/o_proj, gate/up/down_proj, the two "
                        f"layer norms, norm, lm_head) and {type(base).__name__} has no {missing[0] if missing else 'model.layers'}",
                        hint="use a Llama-style causal LM (Llama, Mistral, Qwen2/3), or drop --tp")
    return inner, list(layers)


def _check_divisible(inner, tp: int) -> None:
    cfg = inner.config
    for what, n in (("attention heads", cfg.num_attention_heads), ("key/value heads", getattr(cfg, "num_key_value_heads", None)
                    or cfg.num_attention_heads), ("MLP width", cfg.intermediate_size), ("vocabulary", cfg.vocab_size)):
        if n % tp:
            raise SpecError(f"--tp {tp}: the model's {n} {what} do not split evenly over {tp} GPUs",
                            hint="use a --tp that divides the heads, key/value heads, MLP width and vocabulary")


__all__ = ["TPWrapper", "tp_plan"]
