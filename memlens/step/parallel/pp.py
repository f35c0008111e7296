"""Pipeline parallel (``--pp N``) composed with FSDP2: one pipeline rank's step as torch.distributed.pipelining runs it.

What decides a pipeline rank's peak, from torch's source (torch/distributed/pipelining/, torch 2.13) and
torchtitan's use of it (torchtitan/distributed/pipeline_parallel.py, models/llama3/infra/parallelize.py):

- **its share of the model.** torchtitan splits a Llama by ``generate_llm_fqn_per_model_part(num_stages,
  num_layers, input_weight=1, output_weight=1)``: the embedding and norm + output count as one layer each, the
  ``num_layers + 2`` effective layers are dealt out evenly (the first ``extra`` stages one more), the first stage
  holds the embedding, the last the final norm and the output projection. Stage ``i`` of ``pp x V`` runs on pipeline
  rank ``i % pp`` (``V`` virtual stages per rank with the interleaved schedule). Each stage's module is FSDP2-sharded
  over the data-parallel ranks (``fully_shard`` per block, then the stage module: torchtitan's ``parallelize_fn`` on
  each model part) with ``reshard_after_forward=False`` (torchtitan's default under PP: a block stays gathered from
  its forward to its backward). The mesh is torchtitan's ``(pp, dp_shard)``, ``pp`` outermost.
- **micro-batches in flight.** The local batch (``--batch-size``) is split into ``--pp-microbatches M`` (torch's
  microbatch.py ``split_args_kwargs_into_chunks``: dim-0 views); a stage's forward of a micro-batch keeps its output
  and inputs in ``fwd_cache`` (stage.py ``forward_one_chunk``) and its autograd graph alive until that micro-batch's
  backward. The order of forwards and backwards is the schedule's, run here op by op: GPipe (schedules.py
  ``ScheduleGPipe``) all M forwards then all M backwards; 1F1B (``Schedule1F1B``) ``min(M, pp - stage)`` warm-up
  forwards, then one backward and one forward, then the cool-down backwards; interleaved 1F1B
  (``ScheduleInterleaved1F1B``) the order torch's own ``_calculate_single_rank_operations`` computes for this rank,
  called here. Nothing is counted by formula: the stage's real forward runs for each micro-batch, and what its graph
  saves stays allocated until its backward runs.
- **P2P buffers.** A non-first stage receives each micro-batch's input into a buffer ``_make_tensor_from_meta``
  allocates for every micro-batch once, at the first step (stage.py ``_setup_forward_recv_info``), and keeps for the
  stage's life; the received buffer itself is the stage's input (``requires_grad_``). A non-last stage likewise holds
  one gradient-receive buffer per micro-batch (``_setup_backward_recv_info`` / ``_create_grad_recv_info``). The sent
  tensors are the stage's outputs and input gradients themselves (no copy).
- **backward with FSDP2.** Each micro-batch's backward runs ``backward_maybe_with_nosync``: the stage's FSDP modules
  told ``set_requires_gradient_sync(False)``, ``set_reshard_after_backward(False)``: parameters stay gathered, the
  unsharded gradients accumulate over the micro-batches; after the stage's last backward ``perform_reduce_grad``
  turns sync on and runs each group's ``post_backward`` (the reduce-scatters) and the root's final callback. Both
  torch methods are called here as they are, on the stage's module.
- **the last stage's logits and loss.** The last stage's output is the logits of its micro-batch (kept in
  ``fwd_cache`` until its backward; torchtitan steps with ``return_outputs=False``, so ``output_chunks`` keeps none);
  torchtitan's loss is ``cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))`` scaled by 1 / M
  (``rescale_accumulated_loss``).

- **the first step's stage initialization.** Before the schedule's first forward, ``_initialize_stage`` /
  ``_initialize_stages`` (schedules.py) runs each stage's ``_prepare_forward_infra``, then each one's
  ``_prepare_backward_infra``, as the installed torch does it (told apart by the method 2.13 added, not by a version):
  torch 2.11's ``_shape_inference`` (stage.py) runs one ``torch.no_grad()`` forward of micro-batch 0's shape on
  ``zeros_like`` inputs - FSDP2 gathers the stage's parameters and, with ``reshard_after_forward=False``, keeps them
  gathered into the first real forward - then frees its outputs and allocates the receive buffers; torch 2.13's DYNAMIC
  metadata inference (``_forward_metadata_inference`` under ``enable_grad``, ``_backward_metadata_inference`` through
  ``autograd.grad`` for the inputs alone, ``_post_metadata_inference_cleanup``) runs a forward and an input backward,
  the receive buffers allocated between, then reshards every FSDP module of the stage. Its temporaries are charged to
  ``(pipeline first-step inference)``; the allocations it leaves are the buffers, and the segments it made stay
  reserved (no ``empty_cache``).
- **the last forward's output.** ``ScheduleGPipe`` / ``Schedule1F1B._step_microbatches`` bind each forward's output to
  a local (``output = self._stage.forward_one_chunk(...)``): it stays referenced past its backward until the next
  forward returns, and the last one until the step returns, after the gradients' reduction - on the last stage one
  micro-batch of logits more. The interleaved runtime's ``_perform_action`` drops it at each action's end.

Not modelled: the UNSHARD / RESHARD actions the runtime schedule adds for FSDP (with ``reshard_after_forward=False``
the blocks are gathered from their first forward to the reduce anyway), the P2P sends' NCCL buffers (outside the
caching allocator) and the sent tensors the NCCL work keeps until it is waited (one micro-batch of hidden states or
its gradient each), the metadata objects the first step's inference sends (a few KiB), zero-bubble schedules
(backward split into input and weight passes). Estimated only: on a device the stages would need torch's P2P sends,
which this step does not run (bench/gpu_mesh.py runs torch's own schedule for the GPU measurement).
"""
from __future__ import annotations

import contextlib
import copy
from types import SimpleNamespace

from ...core.enums import Category
from ...core.errors import SpecError
from ...core.parallel import data_parallel_ranks
from .base import RankGroup
from .fsdp import FSDPWrapper

INFERENCE = "(pipeline first-step inference)"   # the pseudo-module of its inputs


def split_layers(num_stages: int, num_layers: int, input_weight: int = 1, output_weight: int = 1) -> list[list[int]]:
    """The decoder layers of each stage by torchtitan's default rule (``generate_llm_fqn_per_model_part``): the
    embedding and the norm + output weigh one layer each; the first stage holds the embedding, the last the output.

    >>> split_layers(2, 4), split_layers(4, 4)
    ([[0, 1], [2, 3]], [[0], [1, 2], [3], []])
    >>> [len(s) for s in split_layers(4, 32)]
    [8, 9, 8, 7]
    """
    eff = num_layers + input_weight + output_weight
    if num_stages > eff:
        raise SpecError(f"--pp: {num_stages} stages are more than the model's {num_layers} layers + embedding + output "
                        "(torchtitan's default split)", hint="use fewer stages (--pp x --virtual-stages)")
    per, extra = divmod(eff, num_stages)
    if input_weight > per or output_weight > per:
        raise SpecError(f"--pp: {num_stages} stages leave {per} effective layer(s) per stage, fewer than the embedding's "
                        "or the output's weight of 1 (torchtitan's default split refuses it)",
                        hint="use fewer stages (--pp x --virtual-stages)")
    out, cur = [], 0
    for s in range(num_stages):
        n = per + (1 if s < extra else 0) - (input_weight if s == 0 else output_weight if s == num_stages - 1 else 0)
        ids = [i for i in range(cur, min(cur + n, num_layers))]
        cur += len(ids)
        out.append(ids)
    return out


def schedule_order(schedule: str, pp: int, rank: int, microbatches: int, virtual: int = 1) -> list[tuple[int, str, int]]:
    """(stage index, "F" or "B", micro-batch) in the order pipeline rank ``rank`` runs them (module docstring).

    >>> schedule_order("1f1b", 4, 2, 4)
    [(2, 'F', 0), (2, 'F', 1), (2, 'B', 0), (2, 'F', 2), (2, 'B', 1), (2, 'F', 3), (2, 'B', 2), (2, 'B', 3)]
    """
    M = microbatches
    if schedule == "gpipe":
        return [(rank, "F", i) for i in range(M)] + [(rank, "B", i) for i in range(M)]
    if schedule == "1f1b":       # schedules.py Schedule1F1B._step_microbatches
        warm = min(M, pp - rank)
        ops = [(rank, "F", i) for i in range(warm)]
        f, b = warm, 0
        while True:
            ops.append((rank, "B", b))
            b += 1
            if f == M:
                break
            ops.append((rank, "F", f))
            f += 1
        ops += [(rank, "B", i) for i in range(b, M)]
        return ops
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B  # heavy: torch, loaded on first use

    rounds = max(1, M // pp)
    me = SimpleNamespace(n_local_stages=virtual, microbatches_per_round=M // rounds, pp_group_size=pp, _n_microbatches=M)
    acts = ScheduleInterleaved1F1B._calculate_single_rank_operations(me, rank)
    return [(a.stage_index, "F" if a.computation_type.name == "FORWARD" else "B", a.microbatch_index)
            for a in acts if a is not None]


def in_flight(order: list[tuple[int, str, int]]) -> int:
    """The most micro-batch forwards whose backward has not run yet, over the order.

    >>> in_flight(schedule_order("1f1b", 4, 0, 8)), in_flight(schedule_order("gpipe", 4, 0, 8))
    (4, 8)
    """
    now = most = 0
    for _, kind, _ in order:
        now += 1 if kind == "F" else -1
        most = max(most, now)
    return most


def _stage_module(causal_lm, layer_ids: list[int], first: bool, last: bool):
    """One stage's module: the Hugging Face decoder with only its layers (embedding on the first stage, norm and
    lm_head on the last), as torchtitan's ``pipeline_module_split`` deep-copies the model and deletes the rest."""
    import torch  # heavy: torch, loaded on first use

    class PipelineStageModule(torch.nn.Module):
        def __init__(self):
            super().__init__()
            inner = copy.copy(causal_lm.model)
            # its own children, parameters, buffers and hooks dicts (the submodules themselves shared)
            inner.__dict__.update({k: type(v)(v) for k, v in vars(inner).items() if isinstance(v, dict)})
            inner.layers = torch.nn.ModuleList([causal_lm.model.layers[i] for i in layer_ids])
            inner.rotary_emb = copy.deepcopy(causal_lm.model.rotary_emb)
            if not first:
                inner.embed_tokens = None
            if not last:
                inner.norm = torch.nn.Identity()
            self.model = inner
            self.lm_head = causal_lm.lm_head if last else None
            self.first, self.last = first, last

        def forward(self, x):
            h = (self.model(input_ids=x) if self.first else self.model(inputs_embeds=x)).last_hidden_state
            return self.lm_head(h) if self.last else h

    return PipelineStageModule()


class PPWrapper(FSDPWrapper):
    """Pipeline rank ``rank // dp`` of ``--pp`` stages, FSDP2 over the ``dp`` ranks of its stage (module docstring)."""

    name = "pp"
    headline_by = "peak_reserved_bytes"     # the stages differ: the estimate's headline is the one that reserves most

    def __init__(self, spec, **kw):
        super().__init__(spec, **kw)
        self.pp = spec.pp
        self.dp = self.world_size // self.pp
        self.shard_size = self.dp
        self.virtual = spec.virtual_stages if spec.pp_schedule == "interleaved-1f1b" else 1
        self.microbatches = spec.pp_microbatches or spec.batch_size
        self.pp_rank = self.rank // self.dp
        self.stages = [self.pp_rank + v * self.pp for v in range(self.virtual)]
        self.raf = spec.reshard_after_forward if spec.reshard_after_forward is not None else False
        mp = "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)" if spec.precision == "amp-bf16" else "no MixedPrecisionPolicy"
        self.settings = f"(reshard_after_forward={self.raf}, {mp})"
        self.order = schedule_order(spec.pp_schedule, self.pp, self.pp_rank, self.microbatches, self.virtual)
        self.chunks: dict = {}
        self.layers: dict[int, list[int]] = {}
        self._recv: dict | None = None
        self._p2p: tuple | None = None       # the P2P tensors' (shape, dtype): a micro-batch of hidden states
        self._tracker = None
        self.applied[-1] = (f"pipeline parallel: rank {self.pp_rank} of {self.pp} ({spec.pp_schedule}, stage"
                            f"{'s' if self.virtual > 1 else ''} {', '.join(map(str, self.stages))}, {self.microbatches} "
                            f"micro-batches of {spec.batch_size // self.microbatches}) + FSDP2 fully_shard per block + stage "
                            f"over {self.dp} GPUs on a {self.pp} x {self.dp} (pp x dp_shard) DeviceMesh {self.settings}")

    @staticmethod
    def first_rank(spec) -> int:
        """The rank simulated first: --pp-stage's first data-parallel rank (else rank 0, stage 0's)."""
        return (spec.pp_stage or 0) * data_parallel_ranks(spec)   # pp is the outermost mesh dim (torchtitan's)

    @property
    def strategy(self) -> str:
        return (f"PP x FSDP2: {self.pp} pipeline ranks ({self.spec.pp_schedule}"
                + (f", {self.virtual} stages each" if self.virtual > 1 else "")
                + f", {self.microbatches} micro-batches), FSDP2 over {self.dp}"
                + (f"; pipeline rank p is ranks {self.dp}p-{self.dp}p+{self.dp - 1}" if self.dp > 1 else "; pipeline rank p is rank p"))

    def make_mesh(self, device_type: str):
        from torch.distributed.device_mesh import init_device_mesh  # heavy: torch, loaded on first use

        self.mesh = init_device_mesh(device_type, (self.pp, self.dp), mesh_dim_names=("pp", "dp_shard"))
        self.facts.update(mesh={"pp": self.pp, "dp_shard": self.dp})
        return self.mesh["dp_shard"]

    def shard_index(self, rank: int) -> int:
        return rank % self.dp

    def before_shard(self, model):
        """The model cut to this rank's stages (torchtitan's split), one module per stage."""
        import torch  # heavy: torch, loaded on first use

        inner = _decoder(model)
        n = len(inner.layers)
        split = split_layers(self.pp * self.virtual, n)
        holder = torch.nn.Module()
        total = self.pp * self.virtual
        for s in self.stages:
            self.layers[s] = split[s]
            holder.add_module(f"stage{s}", _stage_module(model, split[s], s == 0, s == total - 1))
        self.chunks = {s: holder.get_submodule(f"stage{s}") for s in self.stages}
        self.facts.update(pp=self.pp, pp_rank=self.pp_rank, stages={str(s): _describe_stage(split[s], s, total)
                                                                    for s in self.stages},
                          schedule=self.spec.pp_schedule, microbatches=self.microbatches,
                          microbatches_in_flight=in_flight(self.order))
        return holder

    def shard(self, model, mesh, mp) -> list:
        """``fully_shard`` on every block of each stage, then on the stage's module (each stage its own FSDP root)."""
        from torch.distributed.fsdp import fully_shard  # heavy: torch, loaded on first use

        blocks = []
        for chunk in self.chunks.values():
            for b in chunk.model.layers:
                fully_shard(b, mesh=mesh, mp_policy=mp, reshard_after_forward=self.raf)
                blocks.append(b)
            fully_shard(chunk, mesh=mesh, mp_policy=mp, reshard_after_forward=self.raf)
        return blocks

    def rank_groups(self) -> list[RankGroup]:
        """One simulated rank per pipeline rank (its first data-parallel rank: the largest FSDP2 shards), or the one
        ``--pp-stage`` names."""
        picked = [self.spec.pp_stage] if self.spec.pp_stage is not None else range(self.pp)
        total = self.pp * self.virtual
        split = split_layers(total, self.model_config.num_hidden_layers)
        out = []
        for p in picked:
            stages = "; ".join(f"stage {s}: {_describe_stage(split[s], s, total)}" for s in range(p, total, self.pp))
            out.append(RankGroup(p * self.dp, tuple(range(p * self.dp, (p + 1) * self.dp)),
                                 f"pipeline rank {p} ({stages}); its first data-parallel rank, the largest FSDP2 shards "
                                 "(the others of the stage hold as many rows or fewer)"))
        return out

    def shard_inputs(self, batch, seq_len):
        self.seq_len = seq_len
        return batch

    @contextlib.contextmanager
    def simulation(self, tracker, step):
        self._tracker = tracker
        with super().simulation(tracker, step):
            yield

    # ------------------------------------------------------------------ the schedule, op by op
    def run_step(self, step, on_phase):
        """One optimizer step: this rank's forwards and backwards in the schedule's order, each stage's gradients
        reduced after its last backward, then the optimizer step (module docstring)."""
        from torch.distributed.pipelining.stage import _PipelineStageBase  # heavy: torch, loaded on first use

        M, b = self.microbatches, self.spec.batch_size // self.microbatches
        ids, labels = step.batch["input_ids"], step.batch["labels"]
        if self._recv is None:       # the first step: the schedule's _initialize_stage(s) before its first forward
            on_phase("forward")
            self._first_step(step, ids[:b], labels[:b])
        cache: dict = {}
        left = {s: M for s in self.stages}
        phase = held = None
        for s, kind, mb in self.order:
            chunk = self.chunks[s]
            if kind != phase:
                phase = kind
                on_phase("forward" if kind == "F" else "backward")
            if kind == "F":
                x = ids[mb * b:(mb + 1) * b] if chunk.first else self._recv[s]["act"][mb].requires_grad_(True)
                with step.autocast():
                    out = chunk(x)
                if self.virtual == 1:
                    # ScheduleGPipe / Schedule1F1B._step_microbatches: `output = self._stage.forward_one_chunk(...)`,
                    # a local of the step: the last forward's output stays referenced (past its backward, detached)
                    # until the next forward returns, and the last one until the step returns, after the gradients'
                    # reduction (the interleaved runtime's `_perform_action` drops its own at each action's end)
                    held = out
                loss = self._loss(out, labels[mb * b:(mb + 1) * b]) if chunk.last else None
                cache[(s, mb)] = (out, [] if chunk.first else [x], loss)
                del out, loss, x
                continue
            out, inputs, loss = cache.pop((s, mb))
            kw = {"stage_output": loss if chunk.last else (out,), "input_values": inputs,
                  "output_grads": None if chunk.last else (self._recv[s]["grad"][mb],)}
            grads, _ = _PipelineStageBase.backward_maybe_with_nosync(SimpleNamespace(submod=chunk), "full", kw)
            del grads, kw, out, inputs, loss     # the input gradient goes once sent
            left[s] -= 1
            if not left[s]:
                _PipelineStageBase.perform_reduce_grad(SimpleNamespace(submod=chunk), 1)
        del held
        step.run_optimizer(on_phase)
        return None

    def _loss(self, logits, labels):
        """torchtitan's cross-entropy (logits upcast to fp32), rescaled by 1 / M (``rescale_accumulated_loss``)."""
        import torch  # heavy: torch, loaded on first use

        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
        return loss / self.microbatches

    # ------------------------------------------------------------------ the first step's stage initialization
    def _first_step(self, step, ids, labels) -> None:
        """What the schedule's first ``step()`` does before its first forward (``_initialize_stage`` /
        ``_initialize_stages``), as the installed torch does it: each stage's metadata inference (torch >= 2.13) or
        shape inference (2.11), and the receive buffers it allocates after it (module docstring)."""
        import torch  # heavy: torch, loaded on first use
        from torch.distributed.pipelining import PipelineStage  # heavy: torch, loaded on first use

        cfg = self.model_config
        dtype = torch.bfloat16 if self.spec.precision == "amp-bf16" else getattr(torch, self.spec.param_dtype)
        self._p2p = ((self.spec.batch_size // self.microbatches, ids.shape[1], cfg.hidden_size), dtype)
        self._recv = {s: {"act": [], "grad": []} for s in self.stages}
        if hasattr(PipelineStage, "_forward_metadata_inference"):
            self._metadata_inference(step, ids, labels)
            how = "forward + input backward of micro-batch 0, then resharded"
        else:
            self._shape_inference(step, ids)
            how = "no_grad forward of micro-batch 0"
        shape, dtype = self._p2p
        self.facts.update(recv_buffers=sum(len(v["act"]) + len(v["grad"]) for v in self._recv.values()),
                          recv_buffer_shape=list(shape), recv_buffer_dtype=str(dtype).removeprefix("torch."),
                          first_step_inference=how)

    def _shape_inference(self, step, ids) -> None:
        """torch 2.11: ``_initialize_stage(s)`` (schedules.py) runs each stage's ``_prepare_forward_infra`` in turn,
        then each one's ``_prepare_backward_infra``. ``_prepare_forward_infra`` calls ``_shape_inference`` (stage.py):
        the input (the first stage's micro-batch 0, or the metadata received from the previous stage) made
        ``torch.zeros_like(meta, device=...)``, one forward of the stage's module under ``torch.no_grad()`` (FSDP2
        gathers its parameters, kept gathered with ``reshard_after_forward=False``), its outputs turned to meta and
        sent: the real ones freed; then the micro-batches' receive buffers (``_make_tensor_from_meta``).
        ``_prepare_backward_infra`` then allocates the gradient receive buffers (``_create_grad_recv_info``)."""
        import torch  # heavy: torch, loaded on first use

        shape, dtype = self._p2p
        for s in self.stages:
            chunk = self.chunks[s]
            with self._charged(Category.TEMPORARIES, INFERENCE):
                x = torch.zeros_like(ids) if chunk.first else torch.zeros(shape, dtype=dtype)
            with torch.no_grad(), step.autocast():
                out = chunk(x)
            del out, x
            self._make_buffers(s, "act")
        for s in self.stages:
            self._make_buffers(s, "grad")

    def _metadata_inference(self, step, ids, labels) -> None:
        """torch >= 2.13 (DYNAMIC inference, no metadata given to the stage): ``_initialize_pp_stages``
        (schedules.py) runs each stage's ``_prepare_forward_infra``, then each one's ``_prepare_backward_infra`` in
        reverse, then ``_post_metadata_inference_cleanup`` on each (stage.py).
        ``_forward_metadata_inference``: the input (the first stage's micro-batch 0 detached - no copy - or
        ``TensorMeta.to_tensor``'s empty tensor requiring grad), one forward under ``torch.enable_grad()`` whose
        outputs and graph are kept; then the micro-batches' receive buffers. ``_backward_metadata_inference``: the
        last stage's loss (the schedule's loss_fn on target micro-batch 0), another stage's outputs with
        ``_ones_from_metadata`` gradients, through ``_autograd_grad_for_inputs`` (``autograd.grad`` for the inputs
        alone, none on the first stage: its graph is dropped unused); the graph freed as it returns, then the gradient
        receive buffers. The cleanup reshards every FSDP module of the stage and drops any gradient."""
        import torch  # heavy: torch, loaded on first use
        from torch.distributed.fsdp import FSDPModule  # heavy: torch, loaded on first use
        from torch.distributed.pipelining._backward import _autograd_grad_for_inputs  # heavy: torch >= 2.13

        shape, dtype = self._p2p
        kept = {}
        for s in self.stages:
            chunk = self.chunks[s]
            if chunk.first:
                x = ids.detach()
            else:
                with self._charged(Category.TEMPORARIES, INFERENCE):
                    x = torch.empty(shape, dtype=dtype).requires_grad_(True)
            with torch.enable_grad(), step.autocast(), self._graph_torch_drops():
                kept[s] = (x, chunk(x))
            del x
            self._make_buffers(s, "act")
        for s in reversed(self.stages):
            x, out = kept.pop(s)
            if self.chunks[s].last:
                grads = _autograd_grad_for_inputs([self._loss(out, labels)], [x], allow_unused=True)
            else:
                with self._charged(Category.TEMPORARIES, INFERENCE):
                    ones = torch.ones(shape, dtype=dtype)
                grads = _autograd_grad_for_inputs([out], [x], [ones], allow_unused=True)
                del ones
            del grads, x, out
            self._make_buffers(s, "grad")
        for s in self.stages:
            for m in self.chunks[s].modules():
                if isinstance(m, FSDPModule):
                    m.reshard()
                    for p in m.parameters():
                        p.grad = None

    def _make_buffers(self, s: int, kind: str) -> None:
        """Stage ``s``'s receive buffers of one kind, one per micro-batch (stage.py ``_make_tensor_from_meta``): a
        non-first stage's input activations ("act"), a non-last stage's output gradients ("grad"), of the hidden
        states' shape in the compute dtype."""
        import torch  # heavy: torch, loaded on first use

        shape, dtype = self._p2p
        if (kind == "act" and s == 0) or (kind == "grad" and s == self.pp * self.virtual - 1):
            return
        with self._charged(Category.COMMUNICATION, "(pipeline P2P receive buffers)"):
            self._recv[s][kind] = [torch.empty(shape, dtype=dtype) for _ in range(self.microbatches)]

    def _graph_torch_drops(self):
        """The simulation's saved-tensor hook (core.tracker ``pack_hook_for``) returns the tensor itself: an output
        its own op saves (rsqrt, softmax, ...) then holds that op's node, a cycle autograd breaks only when a backward
        releases the graph. torch drops the first stage's inference graph with no backward (on the GPU, with no hook,
        it is freed as the outputs go), so here the saved tensors are packed as detached aliases (no copy, no node)."""
        import torch  # heavy: torch, loaded on first use

        from ...core.tracker import pack_hook_for  # heavy: imports torch

        if self._tracker is None:
            return contextlib.nullcontext()
        pack = pack_hook_for(self._tracker)
        return torch.autograd.graph.saved_tensors_hooks(lambda t: pack(t).detach(), lambda t: t)

    @contextlib.contextmanager
    def _charged(self, category, label: str):
        """Allocations in the block charged to ``category`` and the pseudo-module ``label``."""
        tr = self._tracker
        if tr is None:
            yield
            return
        old = (tr.category_default, tr.module)
        tr.category_default, tr.module = category, tr.log.module_id(label)
        try:
            yield
        finally:
            tr.category_default, tr.module = old

    def wrap(self, model, *, device, fake_mode=None):
        self.model_config = _decoder(model).config
        return super().wrap(model, device=device, fake_mode=fake_mode)


def _describe_stage(layers: list[int], s: int, total: int) -> str:
    parts = (["embedding"] if s == 0 else []) + \
            ([f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers[0]}-{layers[-1]}"] if layers else []) + \
            (["norm + lm_head + loss"] if s == total - 1 else [])
    return " + ".join(parts)


def _decoder(model):
    """The decoder of a Llama-style causal LM (model.embed_tokens, model.layers, model.norm, lm_head), or one line."""
    inner = getattr(model, "model", None)
    missing = [n for n, ok in (("model.embed_tokens", inner is not None and hasattr(inner, "embed_tokens")),
                               ("model.layers", inner is not None and hasattr(inner, "layers")),
                               ("model.norm", inner is not None and hasattr(inner, "norm")),
                               ("lm_head", hasattr(model, "lm_head"))) if not ok]
    if missing:
        raise SpecError(f"--pp splits a Llama-style causal LM (model.embed_tokens, model.layers, model.norm, lm_head) as "
                        f"torchtitan does, and {type(model).__name__} has no {missing[0]}",
                        hint="use a Llama-style causal LM (Llama, Mistral, Qwen2/3), or drop --pp")
    return inner


__all__ = ["PPWrapper", "in_flight", "schedule_order", "split_layers"]
