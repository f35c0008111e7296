"""Make a fake-tensor step on the CPU allocate what the same step allocates on a CUDA device.

The fake step runs real model code on the CPU device, and a few CPU kernels differ in memory
from their CUDA twins. A TorchFunctionMode rewrites exactly those calls:

- ``F.scaled_dot_product_attention``: CUDA runs a fused kernel (flash or memory-efficient) that
  keeps only the output and a float32 logsumexp, where the CPU math path with dropout builds the
  L x L matrix. :class:`FusedAttention` allocates what the CUDA kernels allocate.
- ``F.dropout``: CUDA's fused kernel keeps a 1-byte bool mask (``native_dropout``); the CPU path
  keeps a mask of the input's dtype.
- autocast: the CPU autocast lists differ from CUDA's, so CUDA's policy is applied here, with
  its cache of low-precision copies of fp32 leaf weights that lives until autocast exits.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# CUDA autocast policies (aten/src/ATen/autocast_mode.cpp, AutocastCUDA registrations).
LOWER_PRECISION = {
    "linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "baddbmm", "addmm", "addbmm", "addmv", "addr",
    "mv", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "prelu",
    "chain_matmul", "einsum", "scaled_dot_product_attention", "_convolution", "convolution", "conv_tbc",
}
FP32 = {
    "softmax", "log_softmax", "softmin", "layer_norm", "group_norm", "rms_norm", "cross_entropy", "nll_loss",
    "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div", "binary_cross_entropy_with_logits",
    "cosine_similarity", "cosine_embedding_loss", "exp", "expm1", "log", "log10", "log1p", "log2", "pow", "__pow__",
    "__rpow__", "rsqrt", "reciprocal", "sum", "prod", "cumsum", "cumprod", "acos", "asin", "cosh", "sinh", "tan",
    "erfinv", "softplus", "norm", "dist", "cdist", "pdist", "renorm", "logsumexp", "poisson_nll_loss",
    "margin_ranking_loss", "hinge_embedding_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "multilabel_margin_loss", "__rtruediv__", "__rdiv__",
}


@dataclass
class AttentionCall:
    """One fused-attention call as the CUDA dispatcher would see it (for reports and tests)."""

    backend: str
    shape: tuple
    dtype: str
    dropout: bool


@dataclass
class CudaRules:
    """Settings of the CPU->CUDA mapping, and what it did."""

    autocast_dtype: torch.dtype | None = None
    attention_calls: list[AttentionCall] = field(default_factory=list)


def sdpa_backend(q: torch.Tensor, k: torch.Tensor, attn_mask, dropout_p: float, enable_gqa: bool) -> str:
    """The kernel CUDA's SDPA dispatcher picks on sm80+ (torch 2.4-2.13 default priority).

    flash: fp16/bf16, head dim <= 256, no explicit mask; memory-efficient: masks, fp32, any head
    dim multiple of 8; math otherwise (and for memory-efficient with grouped-query attention).
    """
    half = q.dtype in (torch.float16, torch.bfloat16)
    d = q.shape[-1]
    gqa = enable_gqa and k.shape[-3] != q.shape[-3]
    if half and attn_mask is None and d <= 256 and d % 8 == 0:
        return "flash"
    if not gqa and d % 8 == 0 and q.dtype in (torch.float16, torch.bfloat16, torch.float32):
        return "efficient"
    return "math"


def _ceil_to(x: int, m: int) -> int:
    return (x + m - 1) // m * m


class FusedAttention(torch.autograd.Function):
    """What CUDA's fused SDPA kernels allocate, on fake tensors.

    forward keeps q, k, v, the output (B, L, H, Dv layout) and a float32 logsumexp;
    backward allocates dq, dk, dv plus the kernel's float32 scratch (flash: dq accumulator
    B x L128 x H x D32 and softmax_d B x H x L128; efficient: none for these sizes).
    """

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, backend):
        B, H, L, _ = q.shape
        Dv = v.shape[-1]
        out = torch.empty(B, L, H, Dv, dtype=q.dtype, device=q.device).transpose(1, 2)
        lse_len = L if backend == "flash" else _ceil_to(L, 32)
        lse = torch.empty(B, H, lse_len, dtype=torch.float32, device=q.device)
        ctx.backend = backend
        ctx.has_mask = attn_mask is not None
        if attn_mask is not None:
            ctx.save_for_backward(q, k, v, out, lse, attn_mask)
        else:
            ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors[:5]
        B, H, L, D = q.shape
        grad_out = grad_out.contiguous() if grad_out.stride(-1) != 1 else grad_out
        dq = torch.empty(B, L, H, D, dtype=q.dtype, device=q.device).transpose(1, 2)
        Hk = k.shape[1]
        dk = torch.empty(B, k.shape[2], H, k.shape[3], dtype=k.dtype, device=k.device).transpose(1, 2)
        dv = torch.empty(B, v.shape[2], H, v.shape[3], dtype=v.dtype, device=v.device).transpose(1, 2)
        if ctx.backend == "flash":
            dq_accum = torch.empty(B, _ceil_to(L, 128), H, _ceil_to(D, 32), dtype=torch.float32, device=q.device)
            softmax_d = torch.empty(B, H, _ceil_to(L, 128), dtype=torch.float32, device=q.device)
            del dq_accum, softmax_d
        if Hk != H:  # grouped-query attention: sum expanded head grads down to the kv heads
            dk = dk.reshape(B, Hk, H // Hk, k.shape[2], k.shape[3]).sum(2)
            dv = dv.reshape(B, Hk, H // Hk, v.shape[2], v.shape[3]).sum(2)
        return dq, dk, dv, None, None


def _math_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """The math backend as CUDA runs it (bool dropout mask), in the input dtype."""
    L, S = q.shape[-2], k.shape[-2]
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(rep, dim=-3)
        v = v.repeat_interleave(rep, dim=-3)
    s = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    sq = math.sqrt(s)
    attn = (q * sq) @ (k * sq).transpose(-2, -1)
    if is_causal:
        mask = torch.ones(L, S, dtype=torch.bool, device=q.device).tril()
        attn = attn.masked_fill(~mask, float("-inf"))
    if attn_mask is not None:
        attn = attn.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else attn + attn_mask
    attn = torch.softmax(attn, dim=-1)
    if dropout_p > 0:
        attn = torch.native_dropout(attn, dropout_p, True)[0]
    return attn @ v


def cuda_sdpa(rules: CudaRules, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    backend = sdpa_backend(q, k, attn_mask, dropout_p, enable_gqa)
    rules.attention_calls.append(AttentionCall(backend, tuple(q.shape), str(q.dtype).replace("torch.", ""), dropout_p > 0))
    if backend == "math":
        return _math_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if attn_mask is not None and attn_mask.dtype != torch.bool and attn_mask.dtype != q.dtype:
        attn_mask = attn_mask.to(q.dtype)
    return FusedAttention.apply(q, k, v, attn_mask, backend)


def _cast_args(args, kwargs, cast):
    def c(a):
        if isinstance(a, torch.Tensor):
            return cast(a)
        if isinstance(a, (list, tuple)) and a and all(isinstance(x, torch.Tensor) for x in a):
            return type(a)(cast(x) for x in a)
        return a

    return tuple(c(a) for a in args), {k: c(v) for k, v in kwargs.items()}


class CudaEmulation(TorchFunctionMode):
    """Rewrites the calls whose CPU memory differs from CUDA's (see module docstring)."""

    def __init__(self, rules: CudaRules):
        super().__init__()
        self.rules = rules
        self._cache: dict[int, torch.Tensor] = {}

    def clear_cache(self) -> None:
        self._cache.clear()

    def _lower(self, t: torch.Tensor) -> torch.Tensor:
        dt = self.rules.autocast_dtype
        if not t.is_floating_point() or t.dtype in (dt, torch.float64):
            return t
        # CUDA autocast caches casts of fp32 leaf tensors that require grad (the weights)
        cacheable = t.dtype == torch.float32 and t.requires_grad and t.is_leaf and t._base is None
        if cacheable:
            hit = self._cache.get(id(t))
            if hit is not None:
                return hit
        out = t.to(dt)
        if cacheable:
            self._cache[id(t)] = out
        return out

    @staticmethod
    def _fp32(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and t.dtype in (torch.float16, torch.bfloat16):
            return t.float()
        return t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if self.rules.autocast_dtype is not None and torch.is_autocast_enabled("cpu"):
            if name in LOWER_PRECISION:
                args, kwargs = _cast_args(args, kwargs, self._lower)
            elif name in FP32:
                args, kwargs = _cast_args(args, kwargs, self._fp32)
            with torch._C._DisableAutocast():
                return self._call(func, name, args, kwargs)
        return self._call(func, name, args, kwargs)

    def _call(self, func, name, args, kwargs):
        if func is F.scaled_dot_product_attention:
            return cuda_sdpa(self.rules, *args, **kwargs)
        if func is F.dropout or func is torch.dropout:
            return _cuda_dropout(*args, **kwargs)
        return func(*args, **kwargs)


def _cuda_dropout(input, p=0.5, training=True, inplace=False):
    if not training or p == 0.0 or input.numel() == 0:
        return input
    if p == 1.0:
        return input * 0
    return torch.native_dropout(input, p, True)[0]


@contextlib.contextmanager
def cuda_autocast(emulation: CudaEmulation, dtype: torch.dtype):
    """Autocast with CUDA's policy on fake CPU tensors; the weight-cast cache dies on exit."""
    with torch.autocast("cpu", dtype=dtype):
        try:
            yield
        finally:
            pass
    emulation.clear_cache()


@contextlib.contextmanager
def track_autocast_cache_clears(emulation: CudaEmulation):
    """Clear the emulated cache whenever torch clears its own (e.g. checkpoint recompute exits autocast)."""
    original = torch.clear_autocast_cache

    def clear():
        original()
        emulation.clear_cache()

    torch.clear_autocast_cache = clear
    try:
        yield
    finally:
        torch.clear_autocast_cache = original
