"""liger-kernel's patched model (``--liger``): what ``apply_liger_kernel_to_llama(model=model)`` (and _mistral,
_qwen2, _qwen3, _gemma; TRL's and the Trainer's ``use_liger_kernel=True`` call the same through
``_apply_liger_kernel_to_instance``) puts in place of a causal LM's pieces, and what each kernel allocates.

liger-kernel 0.8.5 (liger_kernel/transformers/monkey_patch.py) replaces, per decoder layer and in the model:

- the RMSNorms (input_layernorm, post_attention_layernorm, the final norm; Qwen3's q_norm and k_norm) by
  ``LigerRMSNormFunction`` (ops/rms_norm.py, casting mode "llama", in_place=True);
- the MLP by ``LigerSwiGLUMLP``: ``down_proj(LigerSiLUMulFunction(gate_proj(x), up_proj(x)))`` (ops/swiglu.py;
  Gemma: ``LigerGEGLUMLP`` with ``LigerGELUMulFunction``, ops/geglu.py, the same allocations);
- ``apply_rotary_pos_emb`` of the modeling module by ``liger_rotary_pos_emb`` (ops/rope.py, the Triton
  implementation the dispatcher picks unless NVIDIA's CuTe DSL is installed);
- the model's forward by ``lce_forward`` (transformers/model/llama.py ...): in training with labels it never calls
  the lm_head: ``LigerForCausalLMLoss`` (transformers/model/loss_utils.py) runs
  ``LigerFusedLinearCrossEntropyFunction`` (ops/fused_linear_cross_entropy.py) on the final hidden states.

On fake tensors (estimate) each kernel is an autograd.Function below whose forward and backward allocate what
liger's Python wrapper allocates around its Triton launches (same shapes, dtypes, order and lifetimes; a Triton
kernel itself allocates nothing and writes in place), computing nothing. On a device (profile) liger's own
``apply_liger_kernel_to_*`` patches the instance (``liger_kernel`` must be installed). Either way the patch is
the instance's: the module globals liger also rewrites are put back, and the RoPE swap is scoped to each
attention call, so a later model in the same process is not patched.

Memory of each kernel (BT tokens, H hidden, V vocabulary):

- RMSNorm: saves its input X and RSTD, one fp32 per row (BT x 4 B); output Y new. Backward: dX written into dY
  (in place), a per-SM fp32 partial dW (sm_count x H x 4 B), summed to the weight's dtype.
- SwiGLU: saves a = gate_proj(x) and b = up_proj(x) only (HF's MLP also keeps silu(a)); c = silu(a) * b new.
  Backward: da and db written into a and b (in place), nothing allocated.
- RoPE: q and k rotated in place (no new q/k); saves cos and sin (shared by all layers). Backward: in place.
- fused linear cross entropy (:func:`flce_forward_allocations`): in forward, grad_input (BT x H, the input's
  dtype) and grad_weight (V x H, the weight's dtype) zeroed, loss_1d (BT fp32), the target mask, and one
  logits chunk (chunk x V) reused (pure bf16/fp16/fp32) or allocated per chunk (AMP, where autocast casts too);
  chunk = next_power_of_2(cdiv(BT, cdiv(V, H))). The gradients are saved for backward, which scales them in
  place and hands them on: no [BT, V] logits tensor exists at any time.

>>> chunk_size(4096, 896, 151936), chunk_size(16384, 4096, 32000)
(32, 2048)
"""
from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from types import MethodType
from typing import Any

from ..core.errors import SpecError
from ..core.gpus import gpu_facts

LIGER_VERSION = "0.8.5"


@dataclass(frozen=True)
class LigerPatch:
    """What liger's ``apply_liger_kernel_to_<arch>(model=...)`` patches in one architecture."""

    apply_fn: str                  # liger_kernel.transformers.monkey_patch's function
    norms: tuple[str, ...]         # each decoder layer's RMSNorms it patches (attribute paths), besides the final norm
    mlp: str = "swiglu"            # its MLP switch: swiglu (LigerSwiGLUMLP, silu only) or geglu (LigerGEGLUMLP, Gemma)


_LLAMA_NORMS = ("input_layernorm", "post_attention_layernorm")
# monkey_patch.py: apply_liger_kernel_to_llama / _mistral / _qwen2 / _qwen3 (q_norm, k_norm too) / _gemma (Gemma 1:
# RMSNorm with casting "gemma" and offset 1, in place, RSTD fp32 as "llama"; LigerGEGLUMLP, whose LigerGELUMulFunction
# (ops/geglu.py) allocates as LigerSiLUMulFunction does)
PATCHES: dict[str, LigerPatch] = {
    "llama": LigerPatch("apply_liger_kernel_to_llama", _LLAMA_NORMS),
    "mistral": LigerPatch("apply_liger_kernel_to_mistral", _LLAMA_NORMS),
    "qwen2": LigerPatch("apply_liger_kernel_to_qwen2", _LLAMA_NORMS),
    "qwen3": LigerPatch("apply_liger_kernel_to_qwen3", _LLAMA_NORMS + ("self_attn.q_norm", "self_attn.k_norm")),
    "gemma": LigerPatch("apply_liger_kernel_to_gemma", _LLAMA_NORMS, mlp="geglu"),
}
# model types liger-kernel 0.8.5 patches (monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN) whose kernels memlens does not model
LIGER_ONLY = frozenset((
    "deepseek_v2 deepseek_v3 deepseek_v4 gemma2 gemma3_text gemma3 gemma4_text gemma4 glm4 glm4v glm4v_moe gpt_oss "
    "internvl llama4_text llama4 llava granite mllama mllama_text_model ministral mixtral muse_glimmer nemotron olmo2 "
    "pixtral olmo3 qwen3_moe qwen2_vl qwen2_vl_text qwen2_5_vl qwen2_5_vl_text qwen3_next qwen3_5 qwen3_5_text "
    "qwen3_5_moe qwen3_5_moe_text qwen3_vl qwen3_vl_text qwen3_vl_moe qwen3_vl_moe_text smollm3 phi3 paligemma "
    "falcon_h1 smolvlm hunyuan_v1_dense hunyuan_v1_moe exaone4").split())


# ---------------------------------------------------------------- facts
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def chunk_size(tokens: int, hidden: int, vocab: int) -> int:
    """The fused linear cross entropy's chunk of tokens (ops/fused_linear_cross_entropy.py
    ``fused_linear_cross_entropy_forward``, chunk_mem_const=1): inc_factor = cdiv(V, H), chunk =
    min(next_power_of_2(cdiv(BT, inc_factor)), BT), so one chunk's logits are about BT x H elements."""
    return min(_next_power_of_2(_cdiv(tokens, _cdiv(vocab, hidden))), tokens)


def liger_facts(spec, source, seq_len: int | None) -> dict[str, Any]:
    """What the estimate reports of liger's fused loss for ``spec``'s micro-batch (Result ``data["liger"]``)."""
    cfg = source.config
    tokens = spec.batch_size * (seq_len or 0)
    H, V = cfg.hidden_size, cfg.vocab_size
    c = chunk_size(tokens, H, V) if tokens else 0
    return {"version": LIGER_VERSION, "apply_fn": PATCHES[cfg.model_type].apply_fn, "tokens": tokens, "hidden_size": H,
            "vocab_size": V, "chunk_size": c, "chunks": _cdiv(tokens, c) if c else 0,
            "fused_loss": spec.loss == "model"}


def applied_line(spec, source, seq_len: int | None, fake: bool) -> str:
    """The PreparedStep.applied line of --liger."""
    f = liger_facts(spec, source, seq_len)
    loss = (f"fused linear cross entropy in {f['chunks']} chunk(s) of {f['chunk_size']} of the {f['tokens']} tokens "
            f"({f['chunk_size']} x {f['vocab_size']} logits at a time, never {f['tokens']} x {f['vocab_size']})"
            if f["fused_loss"] else "no fused loss: without labels (--loss criterion) the logits are materialized")
    how = "simulated kernels, memlens.models.liger" if fake else "liger-kernel's own Triton kernels"
    mlp = "GEGLU" if PATCHES[source.config.model_type].mlp == "geglu" else "SwiGLU"
    return f"liger-kernel {LIGER_VERSION} {f['apply_fn']}: RMSNorm, {mlp} MLP, RoPE, {loss} ({how})"


def refuse(spec, source, fake: bool) -> None:
    """One line for a --liger spec memlens cannot run with liger's kernels (the spec's own clashes: core.spec)."""
    if not spec.liger:
        return
    kind, task = getattr(source, "kind", None), getattr(source, "task", None)
    if kind in ("factory", "module", "timm", "torchvision"):
        raise SpecError(f"--liger patches transformers models by their model_type; {source.name} is a {kind}",
                        hint="drop --liger (a factory applies liger's kernels itself, and memlens runs them as written)")
    if task != "causal-lm":
        raise SpecError(f"--liger is modelled for causal LMs (liger's lce_forward replaces their loss); {source.name} "
                        f"trains {task}", hint="drop --liger")
    mt = source.config.model_type
    if mt not in PATCHES:
        words = (f"liger-kernel {LIGER_VERSION} patches model_type {mt!r}, but memlens does not model its kernels yet"
                 if mt in LIGER_ONLY else f"liger-kernel {LIGER_VERSION} has no patch for model_type {mt!r}")
        raise SpecError(f"--liger: {words}", hint=f"drop --liger (modelled: {', '.join(PATCHES)})")
    cfg = source.config
    if getattr(cfg, "pretraining_tp", 1) > 1:
        raise SpecError(f"--liger: {source.name} has pretraining_tp={cfg.pretraining_tp}, which liger's lce_forward refuses",
                        hint="set pretraining_tp to 1 or drop --liger")
    if PATCHES[mt].mlp == "swiglu" and getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
        raise SpecError(f"--liger: {source.name}'s MLP activation is {cfg.hidden_act!r}; LigerSwiGLUMLP takes silu only",
                        hint="drop --liger")
    if not fake:
        try:
            import liger_kernel.transformers.monkey_patch  # noqa: F401  optional: liger-kernel, for measured runs
        except ImportError as e:
            raise SpecError(f"--liger on a device runs liger-kernel's own kernels, and it cannot be imported ({e})",
                            hint="pip install liger-kernel (or estimate without a GPU: memlens estimate --liger)") from None


# ---------------------------------------------------------------- applying the patch
KERNELS = ("rope", "rms_norm", "swiglu", "fused_linear_cross_entropy")   # apply_liger_kernel_to_*'s switches, all on by default


def apply_liger(model, spec, fake: bool, kernels: tuple[str, ...] = KERNELS) -> None:
    """Patch ``model`` (a transformers causal LM, before LoRA) as liger's ``apply_liger_kernel_to_<arch>(model=model)``
    does: on fake tensors with this module's simulated kernels, on a device with liger's own. ``kernels``: which of
    liger's switches are on (its defaults: all of :data:`KERNELS`)."""
    patch = PATCHES[model.config.model_type]
    modeling = sys.modules[type(model).__module__]
    base = getattr(model, model.base_model_prefix, model)
    if fake:
        gpu = gpu_facts(spec.gpu)
        model._memlens_liger_cc = gpu.compute_capability
        if "fused_linear_cross_entropy" in kernels:
            model.forward = MethodType(lce_forward, model)
        for norm in [base.norm] + [_attr(layer, path) for layer in base.layers for path in patch.norms]:
            if "rms_norm" in kernels:
                norm._memlens_liger_sm = gpu.sm_count
                norm.forward = MethodType(_rms_norm_forward, norm)
        for layer in base.layers:
            if "swiglu" in kernels:
                layer.mlp.forward = MethodType(_swiglu_forward, layer.mlp)
        rope = rotary_pos_emb
    else:
        from liger_kernel.transformers import monkey_patch  # optional: liger-kernel (checked by refuse)
        from liger_kernel.transformers.rope import liger_rotary_pos_emb  # optional: liger-kernel

        before = dict(vars(modeling))
        switches = {("geglu" if k == "swiglu" and patch.mlp == "geglu" else k): k in kernels for k in KERNELS}
        getattr(monkey_patch, patch.apply_fn)(model=model, **switches)
        for name, value in list(vars(modeling).items()):   # liger also rewrites the module's classes and RoPE: put back
            if before.get(name, value) is not value:
                setattr(modeling, name, before[name])
        rope = liger_rotary_pos_emb
    for layer in base.layers if "rope" in kernels else ():   # liger's module-level RoPE swap, this model's attention only
        layer.self_attn._memlens_rope = rope
        layer.self_attn.forward = MethodType(_attention_forward, layer.self_attn)


def _attr(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _attention_forward(self, *args, **kwargs):
    """The attention's own forward calling liger's RoPE where it calls its modeling module's ``apply_rotary_pos_emb``
    (monkey_patch.py sets it module-wide). Here only while this module runs (recomputation included) and only in
    this thread: the module name points at a switch meanwhile, which another thread's model (a plain one being
    estimated beside it) passes through to transformers' own function."""
    modeling = sys.modules[type(self).__module__]
    before = getattr(_ROPE, "fn", None)
    _ROPE.fn = self._memlens_rope
    _rope_switch(modeling, +1)
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        _ROPE.fn = before
        _rope_switch(modeling, -1)


_ROPE = threading.local()      # .fn: the RoPE of the liger attention running in this thread
_ROPE_LOCK = threading.Lock()
_ROPE_USERS: dict[Any, int] = {}


def _rope_switch(modeling, step: int) -> None:
    """Put the switch in ``modeling.apply_rotary_pos_emb`` for the first liger attention running, back out after the last."""
    with _ROPE_LOCK:
        n = _ROPE_USERS.get(modeling, 0) + step
        _ROPE_USERS[modeling] = n
        current = modeling.apply_rotary_pos_emb
        if step > 0 and n == 1:
            def switch(*args, **kwargs):
                return (getattr(_ROPE, "fn", None) or current)(*args, **kwargs)

            switch._memlens_original = current
            modeling.apply_rotary_pos_emb = switch
        elif n == 0 and hasattr(current, "_memlens_original"):
            modeling.apply_rotary_pos_emb = current._memlens_original


# ---------------------------------------------------------------- simulated kernels (fake tensors)
def _autocast_dtype():
    """The autocast dtype the simulated step runs under (CPU autocast stands for CUDA's), or None."""
    import torch  # heavy: torch, loaded on first use

    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None


def _rms_norm_forward(self, hidden_states):
    """LigerRMSNorm.forward (transformers/rms_norm.py) as ``_patch_rms_norm_module`` binds it."""
    return _functions().RMSNorm.apply(hidden_states, self.weight, self._memlens_liger_sm)


def _swiglu_forward(self, x):
    """LigerSwiGLUMLP.forward (transformers/swiglu.py)."""
    return self.down_proj(_functions().SiLUMul.apply(self.gate_proj(x), self.up_proj(x)))


def rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """liger_rotary_pos_emb (transformers/rope.py) -> LigerRopeFunction, simulated."""
    return _functions().Rope.apply(q, k, cos, sin)


def lce_forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                logits_to_keep=0, **kwargs):
    """liger's ``lce_forward`` (transformers/model/llama.py, qwen2.py, qwen3.py, mistral.py): the base model, then in
    training with labels the fused linear cross entropy on the hidden states (skip_logits), else the lm_head's logits
    and the model's own loss."""
    from transformers.modeling_outputs import CausalLMOutputWithPast  # heavy: transformers, loaded on first use

    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         inputs_embeds=inputs_embeds, **kwargs)
    hidden = outputs[0]
    kept = hidden[:, slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep, :]
    loss = logits = None
    if self.training and labels is not None:
        loss = causal_lm_loss(kept, self.lm_head.weight, labels, self.config.hidden_size, cc=self._memlens_liger_cc)
    else:
        logits = self.lm_head(kept)
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
    return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=getattr(outputs, "past_key_values", None))


def causal_lm_loss(hidden, weight, labels, hidden_size: int, cc: tuple[int, int] = (9, 0), ignore_index: int = -100):
    """``LigerForCausalLMLoss`` (transformers/model/loss_utils.py), simulated: labels padded with one ignore_index and
    shifted (two int64 copies), the hidden states flattened, the fused linear cross entropy (mean reduction)."""
    import torch.nn.functional as F  # heavy: torch, loaded on first use

    labels = F.pad(labels, (0, 1), value=ignore_index)
    shift = labels[..., 1:].contiguous().view(-1)
    return _functions().FusedLinearCrossEntropy.apply(hidden.view(-1, hidden_size), weight, shift, None, cc, ignore_index)


def flce_forward_allocations(x, weight, target, bias=None, *, cc: tuple[int, int] = (9, 0), ignore_index: int = -100,
                             accum_dtype=None):
    """What liger's ``fused_linear_cross_entropy_forward`` allocates, in its order, on fake tensors: returns
    (loss, grad_input, grad_weight, grad_bias). Run it where liger runs it: inside an autograd.Function's forward
    (grad mode off), under the step's autocast. For reuse by other liger losses (TRL's DPO/GRPO with liger).

    - grad_input = zeros_like(x); grad_weight = zeros_like(weight) (in ``accum_dtype`` if given) when the weight
      requires grad and x does; grad_bias alike; loss_1d = zeros(BT) fp32; the target mask and its sum (``.item()``).
    - ``_can_use_mm_out``: x and weight of one dtype (fp16/bf16/fp32, and the autocast dtype under autocast): one
      (chunk x V) logits buffer, each chunk's logits, gradient and grad_input slice written into it with ``out=``;
      otherwise (AMP: fp32 weights) ``x_chunk @ weight.t()`` per chunk (autocast casts both), its gradient
      ``@ weight`` into a (chunk x H) result copied into grad_input.
    - grad_weight: ``addmm(out=grad_weight)`` (nothing allocated) when the gradient is fp16/bf16 and the GPU is sm80+,
      with x_chunk cast to its dtype when it is not; else ``grad_weight += mm(g.t(), x_chunk).float()`` (a V x H
      temporary each chunk: fp32 training, or GPUs before sm80).
    """
    import torch  # heavy: torch, loaded on first use

    BT, H = x.shape
    V = weight.shape[0]
    chunk = chunk_size(BT, H, V)
    needs = x.requires_grad
    grad_input = torch.zeros_like(x)
    grad_weight = grad_bias = None
    if needs:
        grad_weight = torch.zeros_like(weight, dtype=accum_dtype) if weight.requires_grad else None
        grad_bias = torch.zeros_like(bias, dtype=accum_dtype) if bias is not None else None
    loss_1d = torch.zeros(BT, dtype=torch.float32, device=x.device)
    mask = target != ignore_index
    total = mask.sum()      # total_n_non_ignore = target_mask.sum().item(): a 0-dim device tensor read by the host
    del total
    ac = _autocast_dtype()
    mm_out = x.dtype == weight.dtype and x.dtype in (torch.float16, torch.bfloat16, torch.float32) and ac in (None, x.dtype)
    storage = torch.empty(chunk, V, dtype=x.dtype, device=x.device) if mm_out and (bias is None or bias.dtype == x.dtype) else None
    for start in _chunk_starts(BT, chunk):
        xc = x[start:start + chunk]
        logits = storage[:xc.shape[0]] if storage is not None else xc @ weight.t()
        if bias is not None and storage is None:
            logits = logits + bias
        logits = logits.contiguous()   # the cross-entropy kernel writes the loss into loss_1d, the gradient into logits
        if needs and not (mm_out and logits.dtype == grad_input.dtype):
            grad_input[start:start + xc.shape[0]] = logits @ weight
        if grad_weight is not None and needs:
            half = logits.dtype in (torch.float16, torch.bfloat16) and tuple(cc) >= (8, 0)
            if half and (grad_weight.dtype == torch.float32 or grad_weight.dtype == logits.dtype):
                cast = xc.to(logits.dtype) if xc.dtype != logits.dtype else None   # then addmm(out=grad_weight)
                del cast
            else:
                grad_weight += torch.mm(logits.t(), xc).float()
        if grad_bias is not None and needs:
            torch.add(grad_bias, logits.sum(dim=0), out=grad_bias)
        del logits, xc
    del storage
    loss = torch.sum(loss_1d)
    if grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
    if grad_bias is not None:
        grad_bias = grad_bias.to(bias.dtype)
    return loss, grad_input, grad_weight, grad_bias


def _chunk_starts(tokens: int, chunk: int) -> list[int]:
    """The chunks simulated: the first, the second and, when shorter, the last. Every chunk allocates and frees the
    same tensors before the next starts (liger dels them at the end of each iteration), with one exception: under
    AMP (fp32 weights) the first chunk's ``grad_logits_chunk @ weight`` leaves autocast's cached low-precision copy
    of the weight (a leaf that requires grad; torch caches it whether or not grad mode is on, and liger's forward
    runs with it off) alive until autocast exits, so from the second chunk on ``x_chunk @ weight.t()`` casts the
    weight's transpose (a view: never cached) while that copy lives: one weight-sized copy more than in the first
    chunk (measured on an H200: bench/results/liger_accuracy.md). The chunks after the second repeat its events
    exactly and change no peak; simulating each of them (up to cdiv(V, H) ~ 170 for Qwen) would only lengthen the
    event log."""
    starts = [0, chunk] if tokens > chunk else [0]
    last = (tokens - 1) // chunk * chunk
    if tokens % chunk and last not in starts:
        starts.append(last)
    return starts


_FUNCTIONS = None


def _functions():
    """The simulated kernels' autograd.Functions (made on first use: torch is heavy)."""
    global _FUNCTIONS
    if _FUNCTIONS is None:
        _FUNCTIONS = _make_functions()
    return _FUNCTIONS


def _make_functions():
    import torch  # heavy: torch, loaded on first use

    class RMSNorm(torch.autograd.Function):
        """LigerRMSNormFunction (ops/rms_norm.py, casting "llama", in_place=True): ``ensure_contiguous`` inputs;
        forward Y = empty(rows, H) in X's dtype, RSTD = empty(rows) fp32, saves X (a view), W, RSTD; backward
        dX written into dY, partial dW empty(sm_count, H) fp32 summed over SMs and cast to W's dtype."""

        @staticmethod
        def forward(ctx, X, W, sm_count):
            X = X.contiguous()
            shape = X.shape
            X2 = X.view(-1, shape[-1])
            Y = torch.empty(X2.shape, dtype=X.dtype, device=X.device)
            rstd = torch.empty(X2.shape[0], dtype=torch.float32, device=X.device)
            ctx.save_for_backward(X2, W, rstd)
            ctx.sm_count = sm_count
            return Y.view(shape)

        @staticmethod
        def backward(ctx, dY):
            dY = dY.contiguous()
            X, W, _ = ctx.saved_tensors
            dW = None
            if ctx.needs_input_grad[1]:
                partial = torch.empty(ctx.sm_count, X.shape[1], dtype=torch.float32, device=X.device)
                dW = partial.sum(dim=0).to(W.dtype)
                del partial
            return dY, dW, None

    class SiLUMul(torch.autograd.Function):
        """LigerSiLUMulFunction (ops/swiglu.py): c = empty_like(a), saves a and b; backward writes da and db into
        a and b and returns them."""

        @staticmethod
        def forward(ctx, a, b):
            a, b = a.contiguous(), b.contiguous()
            shape = a.shape
            a2, b2 = a.view(-1, shape[-1]), b.view(-1, shape[-1])
            c = torch.empty_like(a2)
            ctx.save_for_backward(a2, b2)
            ctx.shape = shape
            return c.view(shape)

        @staticmethod
        def backward(ctx, dc):
            dc.contiguous()
            a, b = ctx.saved_tensors
            return a.view(ctx.shape), b.view(ctx.shape)

    class Rope(torch.autograd.Function):
        """LigerRopeFunction (ops/rope.py): q and k made (B, L, heads, D)-contiguous (a copy only when they are not)
        and rotated in place, cos and sin saved; backward does the same to dq and dk."""

        @staticmethod
        def forward(ctx, q, k, cos, sin):
            if cos.dim() == 2:
                cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
            q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
            cos, sin = cos.contiguous(), sin.contiguous()
            ctx.save_for_backward(cos, sin)
            return q.transpose(1, 2), k.transpose(1, 2)

        @staticmethod
        def backward(ctx, dq, dk):
            dq, dk = dq.transpose(1, 2).contiguous(), dk.transpose(1, 2).contiguous()
            return dq.transpose(1, 2), dk.transpose(1, 2), None, None

    class FusedLinearCrossEntropy(torch.autograd.Function):
        """LigerFusedLinearCrossEntropyFunction (mean/sum reduction): the gradients computed in forward and saved;
        backward checks grad_output against a device 1.0 (``torch.equal``), scales in place and returns them."""

        @staticmethod
        def forward(ctx, x, weight, target, bias, cc, ignore_index):
            loss, gi, gw, gb = flce_forward_allocations(x, weight, target, bias, cc=cc, ignore_index=ignore_index)
            ctx.save_for_backward(gi, gw, gb)
            return loss

        @staticmethod
        def backward(ctx, grad_output):
            gi, gw, gb = ctx.saved_tensors
            one = torch.empty((), dtype=torch.float32, device=grad_output.device)   # torch.tensor(1.0, device=...)
            del one
            return gi, gw, None, gb, None, None

    class Functions:
        pass

    f = Functions()
    f.RMSNorm, f.SiLUMul, f.Rope, f.FusedLinearCrossEntropy = RMSNorm, SiLUMul, Rope, FusedLinearCrossEntropy
    return f


__all__ = ["PATCHES", "LIGER_VERSION", "apply_liger", "refuse", "chunk_size", "liger_facts", "applied_line",
           "flce_forward_allocations", "causal_lm_loss"]
