"""TRL 1.16's fused LM head, as it allocates on a CUDA device.

Every trainer of TRL 1.16 (SFT, DPO, GRPO, ...) patches the model with ``add_fused_lm_head``
(trl/trainer/utils.py) and calls it with ``fused_lm_head=True``: the backbone runs (``model.base_model``,
``use_cache=False``), then ``hidden_states[:, :-1]`` at the positions whose shifted label is not -100 go through
``ChunkedLogProbFunction`` (trl/kernels/chunked_logprob.py): the ``[tokens, vocab]`` logits are never made. What it
allocates, on CUDA (where ``_use_triton`` is true, so only the valid positions are gathered: ``compact``):

- forward: ``hidden_states[mask]`` ``[N, H]`` and ``labels[mask]`` ``[N]``; seven fp32 ``[N]`` running statistics;
  one ``mm_buf`` ``[min(N, 4096), 32768]`` in the compute dtype (autocast's, else the hidden states'); per token
  chunk ``hidden[chunk].to(compute)`` and per vocabulary chunk ``weight[chunk].to(compute)`` (copies when the dtype
  differs, e.g. fp32 weights under bf16 autocast); ``torch.mm(..., out=tile)``; the Triton fold kernel allocates
  nothing; then ``log_z``, the log-probs and the requested outputs (``[N]`` each). Saved for backward: the gathered
  hidden states, the weight, the targets, ``log_z`` and the entropy.
- backward: ``grad_hidden`` zeros ``[N, H]`` fp32, ``grad_weight`` zeros ``[V, H]`` fp32 when the head trains (full
  fine-tuning), a new ``mm_buf``, the chunk copies again, the gradient GEMMs accumulated in place
  (``torch.addmm(..., out_dtype=float32, out=acc)`` for half inputs on CUDA, torch >= 2.8), then
  ``grad_hidden.to(hidden.dtype)`` and ``grad_weight.to(weight.dtype)`` (copies for half tensors).
- after: each per-token output scattered back to ``[rows, seq - 1]`` (``new_zeros(mask.shape).masked_scatter``,
  written here as an ``index_put`` at the same positions: the same two allocations, without the data-dependent
  ``masked_select`` of its backward), and the NLL ``-log_probs.sum() / mask.sum()``.

On fake tensors the fold (TRL's Triton kernel) is left out: it allocates nothing. On a CUDA device with trl
installed, TRL's own function runs (:func:`chunked_log_probs`); on a CPU without it, this class allocates what
TRL's CUDA path does but does not compute the log-probabilities' values (the losses are not finite there).
"""
from __future__ import annotations

import math
from typing import Any

TOKEN_CHUNK = 4096        # trl/kernels/chunked_logprob.py TOKEN_CHUNK_SIZE
VOCAB_CHUNK = 32768       # trl/trainer/utils.py _CHUNKED_LOGPROB_CHUNK_SIZE
OPTIONAL = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor  # heavy: torch, loaded on first use

    return isinstance(t, FakeTensor)


def _addmm_fp32(acc, a, b) -> None:
    """trl ``_addmm_fp32``: ``acc += a @ b`` in fp32. On CUDA with half inputs ``addmm(out_dtype=float32, out=acc)``
    allocates nothing; fake CPU tensors stand for that (the op is left out: no values, no allocation)."""
    import torch  # heavy: torch, loaded on first use

    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif acc.device.type == "cuda":
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    elif not _is_fake(acc):   # a real CPU run: what TRL does off CUDA
        acc.addmm_(a.float(), b.float())


def _chunk_function():
    import torch  # heavy: torch, loaded on first use

    class ChunkedLogProb(torch.autograd.Function):
        """``trl.kernels.ChunkedLogProbFunction`` without the fold's arithmetic (see the module docstring)."""

        @staticmethod
        def forward(ctx, hidden, weight, bias, targets, compute_dtype, outputs):
            ctx.set_materialize_grads(False)
            N, V = hidden.shape[0], weight.shape[0]
            f32 = {"device": hidden.device, "dtype": torch.float32}
            running_max = torch.full((N,), -math.inf, **f32)
            sum_exp, x_sum_exp, sq_sum_exp, z_sum = (torch.zeros((N,), **f32) for _ in range(4))
            max_before_target = torch.full((N,), -math.inf, **f32)
            target_logit = torch.zeros((N,), **f32)
            mm_buf = torch.empty((min(N, TOKEN_CHUNK), VOCAB_CHUNK), device=hidden.device, dtype=compute_dtype)
            for ts in range(0, N, TOKEN_CHUNK):
                n = min(ts + TOKEN_CHUNK, N) - ts
                h = hidden[ts:ts + n].to(compute_dtype)
                for vs in range(0, V, VOCAB_CHUNK):
                    ve = min(vs + VOCAB_CHUNK, V)
                    tile = mm_buf[:n, :ve - vs]
                    torch.mm(h, weight[vs:ve].to(compute_dtype).t(), out=tile)
                    if bias is not None:
                        tile.add_(bias[vs:ve].to(compute_dtype))
                    # the fold (_forward_kernel, Triton): online logsumexp into the [N] statistics, no allocation
                del h
            log_z = running_max + torch.log(sum_exp)
            logprobs = target_logit - log_z
            entropy = log_z - x_sum_exp / sum_exp if "entropy" in outputs else None
            lssp = torch.log(sq_sum_exp) - 2 * torch.log(sum_exp) if "log_sum_sq_probs" in outputs else None
            mean_logits = z_sum / V if "mean_logits" in outputs else None
            is_top1 = (target_logit >= running_max) & (target_logit > max_before_target) if "is_top1" in outputs else None
            ctx.save_for_backward(hidden, weight, bias, targets, log_z, log_z if entropy is None else entropy)
            ctx.compute_dtype = compute_dtype
            ctx.mark_non_differentiable(*(x for x in (lssp, mean_logits, is_top1) if x is not None))
            return logprobs, entropy, lssp, mean_logits, is_top1

        @staticmethod
        def backward(ctx, g_logprobs, g_entropy, *_):
            hidden, weight, bias, targets, log_z, entropy = ctx.saved_tensors
            cd = ctx.compute_dtype
            need_h, need_w, need_b = ctx.needs_input_grad[:3]
            N, V = hidden.shape[0], weight.shape[0]
            f32 = {"device": hidden.device, "dtype": torch.float32}
            grad_hidden = torch.zeros(hidden.shape, **f32) if need_h else None
            grad_weight = torch.zeros(weight.shape, **f32) if need_w else None
            grad_bias = torch.zeros(bias.shape, **f32) if need_b else None
            mm_buf = torch.empty((min(N, TOKEN_CHUNK), VOCAB_CHUNK), device=hidden.device, dtype=cd)
            g_logprobs = g_logprobs.float().contiguous() if g_logprobs is not None else None
            g_entropy = g_entropy.float().contiguous() if g_entropy is not None else None
            for ts in range(0, N, TOKEN_CHUNK):
                n = min(ts + TOKEN_CHUNK, N) - ts
                h = hidden[ts:ts + n].to(cd)
                for vs in range(0, V, VOCAB_CHUNK):
                    ve = min(vs + VOCAB_CHUNK, V)
                    w = weight[vs:ve].to(cd)
                    tile = mm_buf[:n, :ve - vs]
                    torch.mm(h, w.t(), out=tile)
                    if bias is not None:
                        tile.add_(bias[vs:ve].to(cd))
                    # the fold (_backward_kernel, Triton): the tile becomes the logits' gradient in place
                    if grad_hidden is not None:
                        _addmm_fp32(grad_hidden[ts:ts + n], tile, w)
                    if grad_weight is not None:
                        _addmm_fp32(grad_weight[vs:ve], tile.t(), h)
                    if grad_bias is not None:
                        grad_bias[vs:ve] += tile.sum(dim=0, dtype=torch.float32)
                    del w
                del h
            return (grad_hidden.to(hidden.dtype) if grad_hidden is not None else None,
                    grad_weight.to(weight.dtype) if grad_weight is not None else None,
                    grad_bias.to(bias.dtype) if grad_bias is not None else None, None, None, None)

    return ChunkedLogProb


_FN: list = []


def chunked_log_probs(hidden, weight, bias, targets, compute_dtype, outputs, *, softcap=None, logit_scale=1.0):
    """The chunked log-probs: on a CUDA device with trl installed, TRL's own ``ChunkedLogProbFunction`` (its Triton
    kernels; the same allocations, and the values); elsewhere (fake tensors, the CPU) the memory-equal copy above."""
    if hidden.device.type == "cuda":
        try:
            from trl.kernels import ChunkedLogProbFunction  # optional: trl, on a GPU
        except ImportError:
            ChunkedLogProbFunction = None
        if ChunkedLogProbFunction is not None:
            return ChunkedLogProbFunction.apply(hidden, weight, bias, targets, 1.0, VOCAB_CHUNK, softcap, logit_scale,
                                                tuple(outputs))
    if not _FN:
        _FN.append(_chunk_function())
    return _FN[0].apply(hidden, weight, bias, targets, compute_dtype, tuple(outputs))


def backbone_of(model):
    """What ``_fused_forward`` runs: ``self.base_model`` of the causal LM (under peft, of ``get_base_model()``,
    where TRL patches it, its LoRA layers in place)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base, base.base_model


def fused_forward(model, inputs: dict, labels, rows, cols, *, outputs: tuple[str, ...] = ("log_probs",),
                  compute_dtype=None, temperature: float = 1.0, fp32_head: bool = False) -> dict[str, Any]:
    """``model(**inputs, labels=labels, fused_lm_head=True)`` of TRL 1.16 (trl/trainer/utils.py ``_fused_forward``):
    the backbone, the valid positions ``(rows, cols)`` of ``labels[:, 1:] != -100`` gathered (as ``[mask]``), the
    chunked log-probs, scattered back. Returns a dict like ``FusedCausalLMOutput`` (loss, log_probs, entropy, ...,
    label_mask). ``temperature`` does not change memory (a scalar in the kernel). ``fp32_head`` (GRPO's
    ``cast_lm_head_to_fp32``): ``hidden_states.float()`` and the projection in fp32, outside autocast. The backbone's
    outputs stay referenced until the function returns, as ``backbone_outputs`` does in TRL's."""
    import torch  # heavy: torch, loaded on first use

    base, backbone = backbone_of(model)
    out = backbone(**inputs, use_cache=False)
    hidden = out.last_hidden_state[:, :-1]
    shifted = labels[:, 1:]
    mask = shifted != -100
    lm_head = base.get_output_embeddings()
    if fp32_head:
        hidden = hidden.float()
        compute_dtype = torch.float32
    cd = compute_dtype if compute_dtype is not None else hidden.dtype
    text = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    per_token = chunked_log_probs(hidden[rows, cols], lm_head.weight, lm_head.bias, shifted[rows, cols], cd, outputs,
                                  softcap=getattr(text, "final_logit_softcapping", None),
                                  logit_scale=getattr(text, "logit_scale", None) or 1.0)
    names = ("log_probs",) + OPTIONAL
    res: dict[str, Any] = {}
    for name, x in zip(names, per_token):
        res[name] = None if x is None else x.new_zeros(mask.shape).index_put((rows, cols), x)
    res["loss"] = -res["log_probs"].sum() / mask.sum().clamp(min=1)
    res["label_mask"] = mask
    return res


__all__ = ["fused_forward", "chunked_log_probs", "backbone_of", "TOKEN_CHUNK", "VOCAB_CHUNK"]
