"""Context parallel (``--cp N``) composed with FSDP2 (and ``--tp``) for one rank, as torchtitan applies it.

The mesh is torchtitan's (torchtitan/distributed/parallel_dims.py; parallelisms/parallel_dims.py in Dec 2024):
``init_device_mesh(device, ([replicate, ]dp_shard, cp[, tp]), mesh_dim_names=(["replicate", ]"dp_shard", "cp"[, "tp"]))``,
and FSDP2 runs on ``mesh["dp_shard", "cp"]._flatten("dp_shard_cp")`` (HSDP: on ``mesh["replicate", "dp_shard_cp"]``,
``--shard-size`` being dp_shard x cp GPUs): every parameter is sharded over dp_shard x cp ranks (a CP
group shares no parameter shard), its gradients and AdamW states alike; TP (``--tp``) on the last dim as
:mod:`.tp` applies it. What a rank then holds while the step runs:

- **its share of the sequence.** torch's ``context_parallel`` (torch/distributed/tensor/experimental/
  _context_parallel/_attention.py; torchtitan's ``create_context_parallel_ctx`` / ``cp_shard``) shards every listed
  buffer (input ids, labels, the positions) along the sequence with the head-tail load balancer (the sequence cut
  in 2 x N chunks, rank r keeping chunks r and 2N - 1 - r): each rank's micro-batch is L / N tokens, and every
  activation of the model outside attention (embeddings, norms, MLP, logits, loss) is that of L / N tokens.
  Here the rank's input ids and labels are L / N tokens of the job's batch (:meth:`CPWrapper.shard_inputs`);
  the positions stay the model's own (Hugging Face computes its rotary cos / sin from them, one (L / N) x head_dim
  table, as torchtitan's sharded ``freqs_cis``);
- **ring attention.** SDPA on the rank's queries needs every rank's keys and values: torch dispatches the
  fused kernel's aten op to ``_templated_ring_attention`` (forward) and ``_templated_ring_attention_backward``.
  Those two functions of the installed torch run **as is** here, on fake tensors under the fake process group, on
  the CP sub-group: ``key.contiguous()`` / ``value.contiguous()`` copies, the flat K/V ``cat`` and its
  all-gather over the N ranks (``_AllGatherRotater``, torch's and torchtitan's default rotate method), one kernel
  call per ring step on the round-robin chunks (``chunk`` views: the full local queries against half the keys,
  or half the queries against all of them), the merger's fp32 outputs and logsumexp (``convert_to_f32``) with
  its ``sigmoid`` / ``logsigmoid`` temporaries and ``_partial_update`` concatenations; backward: fp32
  zero-initialised dq / dk / dv accumulators, the K/V all-gather again, the dK/dV all-to-all rotation of every
  step (``_AllToAllRotater``: a flat fp32 buffer per step) and the casts back to the input dtype. The kernel
  each step calls is memlens' stand-in for CUDA's fused kernel (memlens.estimator.cuda_rules: its output,
  softmax statistics, RNG state and backward scratch; the per-step op is the aten op torch's handler would call,
  ``_scaled_dot_product_{cudnn,flash,efficient}_attention``), since a CPU build has no such kernel. Autograd
  keeps what the aten attention op's node keeps: q, k, v, the merged output and logsumexp. Selective activation
  checkpointing sees that one aten op on the GPU: it keeps the merged output and logsumexp (not each ring step's
  kernel outputs) and does not run the forward ring again in its recomputation; full checkpointing does.

Ranks differ by their place in the CP group (rank 0 computes half its queries against the full keys at every
later ring step, the last CP rank its full queries against half the keys) and by their FSDP2 shard (the first
ranks of the dp_shard x cp group hold the largest padded shards): the first and last CP index are simulated;
ranks between are bounded by them (each ring step is one of those two shapes).

Refused in one line: attention that is not causal SDPA without a mask (an attention mask, padding, sliding
windows; ``--attn eager``; the math path of fp32 grouped-query attention), a sequence that does not split into
2 x N chunks, DP-SGD, QLoRA.

On a device (``memlens profile --cp N`` under torchrun, bench/gpu_mesh.py) the same wrapper builds the same mesh,
feeds each rank its L / N tokens and enters torch's own ``context_parallel`` for the process, so the model's SDPA
calls run torch's ring attention with the real kernels (not yet measured on GPUs).
"""
from __future__ import annotations

import warnings

from ...core.errors import SpecError
from ...models.checkpoint import kernel_outputs, opaque_kernels, outside_selective_checkpoint, selective_checkpoint_phase
from .base import RankGroup
from .fsdp import local_rows
from .tp import TPWrapper

# the attention kernels torch's CP handler dispatches to the ring (its custom_ops: cudnn, flash, efficient)
RING_BACKENDS = ("cudnn", "flash", "efficient")


class CPWrapper(TPWrapper):
    """FSDP2 over dp_shard x cp, ring attention over cp, TP over tp (module docstring)."""

    name = "cp"

    def __init__(self, spec, **kw):
        super().__init__(spec, **kw)
        self.cp = spec.cp
        self.dp_shard = self.shard_size // self.cp          # HSDP: --shard-size is dp_shard x cp GPUs
        self.cp_group = None
        rep = f"{self.replicas} x " if self.hsdp else ""
        dims = f"{rep}{self.dp_shard} x {self.cp}" + (f" x {self.tp}" if self.tp > 1 else "")
        names = ("(replicate x " if self.hsdp else "(") + "dp_shard x cp" + (" x tp)" if self.tp > 1 else ")")
        tp = (f"DTensor tensor parallel over {self.tp} GPUs (torchtitan's Llama plan), " if self.tp > 1 else "")
        self.applied[-1] = (f"context parallel over {self.cp} GPUs (torch's ring attention, all-gather K/V rotation, "
                            f"head-tail load balancing: each rank 1/{self.cp} of the sequence) + {tp}FSDP2 fully_shard "
                            f"per block + root over dp_shard_cp = {self.shard_size} GPUs on a {dims} DeviceMesh {names} "
                            f"{self.settings}")

    @property
    def strategy(self) -> str:
        return (f"FSDP2 x CP: context parallel over {self.cp} GPUs (ring attention), FSDP2 over dp_shard x cp = "
                f"{self.shard_size}" + (f", tensor parallel over {self.tp}" if self.tp > 1 else "")
                + (f", replicated {self.replicas} times (HSDP)" if self.hsdp else ""))

    def make_mesh(self, device_type: str):
        from torch.distributed.device_mesh import init_device_mesh  # heavy: torch, loaded on first use

        from .tp import fresh_dtensor_caches

        fresh_dtensor_caches()
        shape, names = (self.dp_shard, self.cp), ("dp_shard", "cp")
        if self.hsdp:
            shape, names = (self.replicas,) + shape, ("replicate",) + names
        if self.tp > 1:
            shape, names = shape + (self.tp,), names + ("tp",)
        self.mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        self.cp_group = self.mesh["cp"].get_group()
        self.facts.update(mesh=dict(zip(names, shape)), cp=self.cp, fsdp_over=self.shard_size)
        flat = self.mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        if not self.hsdp:
            return flat
        with warnings.catch_warnings():    # torch 2.13 warns that slicing a flattened dim will be deprecated; it still works
            warnings.simplefilter("ignore", UserWarning)
            return self.mesh["replicate", "dp_shard_cp"]     # torchtitan's (dp_replicate, dp_shard_cp) of Dec 2024

    def wrap(self, model, *, device, fake_mode=None):
        model = super().wrap(model, device=device, fake_mode=fake_mode)
        if not self.fake:
            self._cp_context = enable_ring_dispatch(self.mesh["cp"], device)
        return model

    def before_shard(self, model):
        return super().before_shard(model) if self.tp > 1 else model

    def cp_index(self, rank: int) -> int:
        return (rank // self.tp) % self.cp

    def rank_groups(self) -> list[RankGroup]:
        """Ranks alike in shard rows and ring shape; CP indices other than the first and last are bounded by them."""
        n, s = self.world_size, self.shard_size
        ends = {0: "first", self.cp - 1: "last"}
        sig = {r: (tuple(local_rows(d, s, self.shard_index(r)) for d, _ in self.dim0s), ends.get(self.cp_index(r)))
               for r in range(n)}
        groups: dict = {}
        for r in range(n):
            groups.setdefault(sig[r], []).append(r)
        out, between = [], []
        for (_, end), ranks in groups.items():
            if end is None:
                between.extend(ranks)
                continue
            out.append(RankGroup(ranks[0], tuple(ranks), f"CP index {self.cp_index(ranks[0])} ({end} of the ring: "
                                 + ("half its queries against all keys at later steps)" if end == "first" else
                                    "its queries against half the keys at later steps)")))
        if between:
            out.append(RankGroup(-1, tuple(sorted(between)), "CP indices between the first and the last: each ring step "
                                 "is one of the two simulated shapes"))
        return out

    def shard_inputs(self, batch, seq_len):
        """The rank's L / N tokens of every sequence tensor of the batch (input ids, labels: one tensor each)."""
        if not seq_len or seq_len % (2 * self.cp):
            raise SpecError(f"--cp {self.cp}: the sequence of {seq_len} tokens does not split into 2 x {self.cp} equal "
                            "chunks (torch's head-tail load balancing of causal attention)",
                            hint=f"use a --seq-len that divides by {2 * self.cp}")
        n = seq_len // self.cp
        done: dict[int, object] = {}
        out = {}
        for k, t in batch.items():
            if getattr(t, "dim", lambda: 0)() >= 2 and t.shape[1] == seq_len:
                if id(t) not in done:
                    done[id(t)] = t[:, :n].clone()
                out[k] = done[id(t)]
            else:
                out[k] = t
        self.facts.update(tokens_per_rank=n)
        return out

    def ring_attention(self, kernel_forward, kernel_backward):
        """The autograd function that stands for SDPA under CP: torch's ring around the kernel's stand-ins."""
        return ring_attention_function(self.cp_group, kernel_forward, kernel_backward)


def enable_ring_dispatch(cp_mesh, device):
    """On a device (torchrun): torch's ``context_parallel`` entered for the rest of the process, so every
    ``F.scaled_dot_product_attention`` of the model runs torch's ring attention over ``cp_mesh`` (its monkey-patch
    mode, head-tail load balancing). Its one listed buffer is a dummy: the inputs are already the rank's share
    (:meth:`CPWrapper.shard_inputs`). Returns the entered context (kept alive by the wrapper)."""
    import torch  # heavy: torch, loaded on first use
    from torch.distributed.tensor.experimental import context_parallel  # heavy: torch, loaded on first use

    dummy = torch.zeros(1, 2 * cp_mesh.size(), device=device)      # (batch, sequence), as input ids are listed
    ctx = context_parallel(cp_mesh, buffers=[dummy], buffer_seq_dims=[1], no_restore_buffers={dummy})
    ctx.__enter__()
    return ctx


def _ring_functions():
    """torch's ring attention, forward and backward (moved into _context_parallel/ in torch 2.10)."""
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention as ring  # heavy: torch
    except ImportError:
        from torch.distributed.tensor.experimental import _attention as ring  # heavy: torch (2.6 - 2.9)
    return ring


def ring_attention_function(group, kernel_forward, kernel_backward):
    """An autograd function (``apply(q, k, v, attn_mask, backend)``, as memlens' fused attention) whose forward and
    backward are torch's ``_templated_ring_attention`` and ``_templated_ring_attention_backward`` on ``group``,
    each ring step calling the fused kernel's stand-in (``kernel_forward`` / ``kernel_backward``)."""
    import torch  # heavy: torch, loaded on first use

    ring = _ring_functions()
    opts = ring._cp_options

    def refuse(backend, attn_mask, dropout_p, is_causal):
        what = ("an attention mask" if attn_mask is not None else "non-causal attention" if not is_causal
                else "dropout" if dropout_p else f"the {backend} path" if backend not in RING_BACKENDS else None)
        if what is not None:
            raise SpecError(f"--cp: torch's load-balanced ring attention takes causal SDPA without a mask through the cuDNN, "
                            f"flash or memory-efficient kernel, and this model's attention has {what}",
                            hint="use a decoder with causal SDPA (no padding, no sliding window; bf16 or amp-bf16 for "
                                 "grouped-query heads), or drop --cp")

    def with_options(fn, *a, **k):
        saved = (opts.enable_load_balance, opts.rotate_method, opts.convert_to_f32)
        opts.enable_load_balance, opts.rotate_method, opts.convert_to_f32 = True, ring._RotateMethod.ALL_GATHER, True
        try:
            return fn(*a, **k)
        except RuntimeError as e:
            msg = (str(e).splitlines() or [type(e).__name__])[0][:160]
            raise SpecError(f"--cp: torch's ring attention fails on this rank's shapes: {msg}",
                            hint="the memory-efficient kernel (fp32) pads its logsumexp to 32 rows: use a --seq-len "
                                 "whose L / cp / 2 divides by 32, or bf16 / amp-bf16") from None
        finally:
            opts.enable_load_balance, opts.rotate_method, opts.convert_to_f32 = saved

    class RingAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, attn_mask, backend):
            def op(query, key, value, is_causal=None, **_):
                out, stats, rng, _mask = kernel_forward(query, key, value, None, backend)
                return (out, stats, *rng)

            # selective checkpointing sees one aten attention op on the GPU (torch's CP handler runs the ring inside it):
            # its forward keeps that op's merged output and logsumexp (a clone stands for the op here: the ring's own
            # ops run outside its cache), and its recomputation takes them from the cache without running the ring
            phase = selective_checkpoint_phase()
            if phase == "recompute":
                with outside_selective_checkpoint():
                    out, lse = q.new_empty(0), q.new_empty(0, dtype=torch.float32)     # replaced by the cached outputs
            else:
                with outside_selective_checkpoint(), opaque_kernels():
                    out, lse, *_rest = with_options(ring._templated_ring_attention, group, 2, op, q, k, v, is_causal=True)
            if phase is not None:
                with kernel_outputs():
                    out, lse = out.clone(), lse.clone()
            ctx.backend = backend
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, grad_out):
            q, k, v, out, lse = ctx.saved_tensors[:5]

            def op(query, key, value, out, logsumexp, is_causal=None, grad_out=None, **_):
                return kernel_backward(ctx.backend, query, key, value, out, logsumexp)[:3]

            dq, dk, dv = with_options(ring._templated_ring_attention_backward, group, 2, op, grad_out, "grad_out",
                                      q, k, v, out, lse, is_causal=True)[:3]
            return dq, dk, dv, None, None

    RingAttention.refuse = staticmethod(refuse)
    # the kernel calls one SDPA is on this rank (the step-time model prices each: memlens.estimator.cuda_rules.cuda_sdpa):
    # a step per rank of the ring, each the local queries against one K/V chunk; with head-tail load balancing a
    # rank's causal work is its share of the whole causal attention, cp causal chunks' worth
    RingAttention.ring_steps = group.size()
    return RingAttention


__all__ = ["CPWrapper", "RING_BACKENDS", "ring_attention_function"]
