"""Make a fake-tensor step on the CPU allocate what the same step allocates on a CUDA device.

The fake step runs real model code on the CPU device, and a few CPU kernels differ in memory
from their CUDA twins. A TorchFunctionMode rewrites exactly those calls:

- ``F.scaled_dot_product_attention``: CUDA runs a fused kernel (flash or memory-efficient) that
  keeps only the output and a float32 logsumexp, where the CPU math path with dropout builds the
  L x L matrix. :class:`FusedAttention` allocates what the CUDA kernels allocate.
- ``F.dropout``: CUDA's fused kernel keeps a 1-byte bool mask (``native_dropout``); the CPU path
  keeps a mask of the input's dtype.
- ``torch._grouped_mm`` (MoE experts, transformers' default ``grouped_mm`` experts implementation) of
  fp32/fp16 operands: CUDA runs a per-group loop of matmuls into one output; torch's meta kernel
  (what fake tensors run) accepts bf16 only. :class:`LoopedGroupedMM` allocates what CUDA allocates.
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

from ..core.gpus import gpu_facts
from ..models.adapt import KNOWN, mark_known
from ..models.checkpoint import kernel_outputs
from ..models.vlm import constant_arange, constant_tensor, constants_on

# CUDA autocast policies (aten/src/ATen/autocast_mode.cpp: AT_FORALL_LOWER_PRECISION_FP,
# AT_FORALL_FP32, AT_FORALL_FP32_SET_OPT_DTYPE), by the Python names of the calls that reach them.
LOWER_PRECISION = {
    "linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "baddbmm", "addmm", "addbmm", "addmv", "addr",
    "mv", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "prelu",
    "chain_matmul", "einsum", "scaled_dot_product_attention", "_convolution", "convolution", "conv_tbc",
    "linalg_vecdot", "multi_dot",
}
FP32 = {  # inputs cast to fp32 (a copy) before the op
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow", "__pow__", "__rpow__", "softplus", "layer_norm", "native_layer_norm", "group_norm",
    "frobenius_norm", "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss",
    "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss",
    "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
}
SET_OPT_DTYPE = {  # output dtype set to fp32 unless given: the kernel upcasts, no input copy
    "softmax", "log_softmax", "cumprod", "cumsum", "prod", "sum", "linalg_vector_norm", "linalg_matrix_norm",
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
    gpu: object = None                 # memlens.core.gpus.GpuFacts (None: the default GPU)
    fused_attention: object = None     # the autograd.Function for fused SDPA (None: FusedAttention; --compile traces its own)
    compile_trace: bool = False        # --compile's trace is running (compiled.py)
    on_attention: object = None        # (backend, q, k, v, is_causal, out) per fused call: the step-time pricing (timing/record.py)


def sdpa_backend(q: torch.Tensor, k: torch.Tensor, attn_mask, dropout_p: float, enable_gqa: bool, gpu=None, v=None) -> str:
    """The kernel CUDA's SDPA dispatcher picks (``torch._fused_sdp_choice``) on ``gpu``
    (:class:`memlens.core.gpus.GpuFacts`; default H100).

    Hopper (measured: H100, torch 2.11, bench/results/raw/gpu_calibration.json): fp16/bf16 go to
    cuDNN attention, with or without masks, dropout or grouped-query attention (head dim <= 128;
    flash above). Ampere / Ada (PyTorch's order without cuDNN first, documented, not measured
    here): flash for fp16/bf16 without a mask, head dim <= 256. fp32 everywhere: memory-efficient
    attention, or math with grouped-query attention (the memory-efficient kernel does not take
    enable_gqa).

    Every fused kernel refuses inputs whose last dimension is not contiguous, the mask's included
    on GPUs (sdp_utils ``check_last_dim_stride_equals_1_dense``): T5's relative position bias is a
    permuted embedding (strides (H, 1, S*H, H)), so T5 runs the math path (measured on an H100,
    bench/results/raw/gpu_t5_sdpa_probe.json). cuDNN refuses a mask that requires grad; the
    memory-efficient kernel takes it and returns its gradient (measured: choice 2 on an H200).
    """
    facts = gpu if gpu is not None else gpu_facts(None)
    half = q.dtype in (torch.float16, torch.bfloat16)
    d = q.shape[-1]
    gqa = enable_gqa and k.shape[-3] != q.shape[-3]
    if any(t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1 for t in (q, k, v, attn_mask) if t is not None):
        return "math"
    mask_grad = attn_mask is not None and attn_mask.requires_grad
    if half and facts.cudnn_attention and d <= 128 and d % 8 == 0 and not mask_grad:
        return "cudnn"
    if half and facts.flash_attention and d <= 256 and d % 8 == 0 and attn_mask is None:
        return "flash"
    if not gqa and d % 8 == 0 and q.dtype in (torch.float16, torch.bfloat16, torch.float32):
        return "efficient"
    return "math"


def _ceil_div(n: int, k: int) -> int:
    return -(-n // k)


def _ceil_to(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _bhld(like: torch.Tensor, B: int, H: int, L: int, D: int) -> torch.Tensor:
    """A (B, H, L, D) tensor laid out as (B, L, H, D), as the fused kernels write it."""
    return torch.empty(B, L, H, D, dtype=like.dtype, device=like.device).transpose(1, 2)


def _matching_layout(like: torch.Tensor, shape: tuple) -> torch.Tensor:
    """A tensor of ``shape`` laid out in ``like``'s stride order, as cuDNN attention allocates its
    output and gradients (aten/src/ATen/native/cudnn/MHA.cpp ``alloc_with_matching_layout``): a
    contiguous (B, H, L, D) query (Phi's partial-rotary ``cat``) gets a (B, H, L, D) output, which the
    model's ``transpose(1, 2).contiguous()`` then copies (measured on an H100: one more output-sized
    block per layer of Phi-1.5 than a (B, L, H, D) output gives)."""
    order = sorted(range(like.dim()), key=lambda i: -like.stride(i))
    t = torch.empty([shape[i] for i in order], dtype=like.dtype, device=like.device)
    return t.permute([order.index(i) for i in range(like.dim())])


def _kernel_output(backend: str, like: torch.Tensor, shape: tuple) -> torch.Tensor:
    """An output or gradient of a fused attention kernel: cuDNN's in ``like``'s layout, the
    others' laid out as (B, L, H, D)."""
    return _matching_layout(like, shape) if backend == "cudnn" else _bhld(like, *shape)


class FusedAttention(torch.autograd.Function):
    """What CUDA's fused SDPA kernels allocate, on fake tensors (sizes measured on an H100).

    forward keeps q, k, v, the output and the softmax statistics:
      cudnn: stats (B, H, L) fp32 plus two 8-byte RNG tensors; a bool mask becomes an additive
      mask in the query dtype, kept for backward;
      efficient: logsumexp (B, H, ceil32(L)) fp32; a bool mask becomes an fp32 additive mask;
      flash: logsumexp (B, H, L) fp32 plus the RNG pair.
    backward allocates dq, dk, dv and the kernel's scratch while they are written:
      cudnn: no scratch beside them (dk/dv at the kv heads' size under grouped-query attention),
      then a workspace: fp32 dQ, with grouped-query attention dK/dV for every query head, the
      statistics' size;
      efficient: one output-sized buffer and two logsumexp-sized buffers; a mask that requires
      grad gets its gradient over the expanded (B, H, L, ceil16(S)) bias, then summed to its shape;
      in fp32, a dq workspace after dk/dv (other backends with grouped-query attention: dk/dv for
      every query head, summed per kv head);
      flash: a float32 dq accumulator (B, ceil128(L), H, ceil32(D)) and softmax_d (B, H, ceil128(L)).
    """

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, backend):
        out, stats, rng, attn_mask = attention_kernel_forward(q, k, v, attn_mask, backend)
        ctx.backend = backend
        ctx.save_for_backward(q, k, v, out, stats, *rng, *(() if attn_mask is None else (attn_mask,)))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, stats = ctx.saved_tensors[:5]
        mask = ctx.saved_tensors[-1] if ctx.needs_input_grad[3] else None
        return (*attention_kernel_backward(ctx.backend, q, k, v, out, stats, mask), None)


def attention_kernel_forward(q, k, v, attn_mask, backend: str):
    """What one fused attention kernel's forward allocates (:class:`FusedAttention`): (the output, the softmax
    statistics, the RNG pair (empty for efficient), the mask as the kernel keeps it)."""
    B, H, L, _ = q.shape
    dev = q.device
    with kernel_outputs():        # one aten op's outputs on the GPU: selective checkpointing keeps them
        out = _kernel_output(backend, q, (B, H, L, v.shape[-1]))
        if backend == "efficient":
            stats = torch.empty(B, H, _ceil_to(L, 32), dtype=torch.float32, device=dev)
            rng = ()
        else:
            stats = torch.empty(B, H, L, dtype=torch.float32, device=dev)
            rng = (torch.empty((), dtype=torch.int64, device=dev), torch.empty((), dtype=torch.int64, device=dev))
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.empty(attn_mask.shape, dtype=q.dtype, device=dev)  # additive mask
    return out, stats, rng, attn_mask


def attention_kernel_backward(backend: str, q, k, v, out, stats, mask=None):
    """What one fused attention kernel's backward allocates (:class:`FusedAttention`): (dq, dk, dv, the mask's
    gradient when ``mask`` is given: the efficient kernel's grad_bias)."""
    B, H, L, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    dev = q.device
    dq = _kernel_output(backend, q, (B, H, L, D))
    if backend == "cudnn":
        # dq, dk and dv (dk and dv at the kv heads' size under grouped-query attention), then cuDNN's workspace,
        # freed when the call returns: dQ accumulated in fp32, with grouped-query attention dK and dV for every query
        # head, the softmax statistics' size and 256 bytes (measured on an H100, torch 2.11, cuDNN 9.19: GPT-2 XL bf16,
        # 25 heads of 64, 2 x 512 tokens: 6,656,256 B; Llama-3.2-3B, 24 query and 8 kv heads of 128, 2 x 1,024 tokens:
        # 50,528,512 B)
        dk = _kernel_output(backend, k, (B, Hk, S, k.shape[-1]))
        dv = _kernel_output(backend, v, (B, Hk, S, v.shape[-1]))
        expanded = B * H * S * (k.shape[-1] + v.shape[-1]) * k.element_size() if Hk != H else 0
        workspace = torch.empty(B * H * L * D * 4 + expanded + B * H * L * 4 + 256, dtype=torch.uint8, device=dev)
        if Hk != H:   # cuDNN sums each kv head's query-head gradients into dk and dv: the same reads and writes here,
            # into the gradients already made (no allocation: the step-time model prices the pass)
            for g, at in ((dk, B * H * L * D * 4), (dv, B * H * L * D * 4 + B * H * S * k.shape[-1] * k.element_size())):
                part = workspace[at:at + B * H * S * g.shape[-1] * g.element_size()].view(g.dtype)
                torch.sum(part.view(B, Hk, H // Hk, S, g.shape[-1]), dim=2, out=g)
        del workspace
        return dq, dk, dv, None
    scratch: list[torch.Tensor] = []  # kernel scratch, alive while dk and dv are written
    if backend == "efficient":
        scratch = [_bhld(out, B, H, L, out.shape[-1]), torch.empty_like(stats), torch.empty_like(stats)]
    elif backend == "flash":
        scratch = [torch.empty(B, _ceil_to(L, 128), H, _ceil_to(D, 32), dtype=torch.float32, device=dev),
                   torch.empty(B, H, _ceil_to(L, 128), dtype=torch.float32, device=dev)]
    if Hk != H:  # grouped-query attention: grads for every query head, then summed per kv head
        dk_full, dv_full = _bhld(k, B, H, S, k.shape[-1]), _bhld(v, B, H, S, v.shape[-1])
        scratch.clear()
        dk = dk_full.reshape(B, Hk, H // Hk, S, k.shape[-1]).sum(2)
        dv = dv_full.reshape(B, Hk, H // Hk, S, v.shape[-1]).sum(2)
    else:
        dk = _kernel_output(backend, k, (B, H, S, k.shape[-1]))
        dv = _kernel_output(backend, v, (B, H, S, v.shape[-1]))
        scratch.clear()
    dmask = full = None
    if mask is not None:  # efficient kernel: grad_bias over the expanded (B, H, L, ceil16(S)) bias
        full = torch.empty(B, H, L, _ceil_to(S, 16), dtype=mask.dtype, device=dev)[..., :S]
    if backend == "efficient" and q.dtype == torch.float32:
        # the fp32 kernel accumulates dq in a float workspace, allocated after the gradients and freed when the call
        # returns (attention_backward.cu `p.workspace_size()`; kernel_backward.h: per batch and head, a
        # GradQTempStorage of kBlockSizeI x kBlockSizeJ floats (64 x 64 in fp32) and a 16-byte counter per tile of
        # queries and of the head dim): 4,198,400 B for GPT-2 medium at 2 x 512 tokens, measured on an H100
        tiles = _ceil_div(L, 64) * _ceil_div(D, 64)
        workspace = torch.empty(B * H * tiles * (64 * 64 * 4 + 16), dtype=torch.uint8, device=dev)
        del workspace
    if full is not None:
        lead = full.dim() - mask.dim()
        dims = [*range(lead), *(lead + i for i, m in enumerate(mask.shape) if m == 1 and full.shape[lead + i] != 1)]
        dmask = full.sum(dims, keepdim=True).reshape(mask.shape) if dims else full
    return dq, dk, dv, dmask


def _math_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """The math backend as CUDA runs it (aten/src/ATen/native/transformers/attention.cpp
    ``_scaled_dot_product_attention_math``, torch 2.5 and later): half inputs are upcast to fp32 and
    the whole L x S computation (scores, softmax, dropout) is fp32, kept for backward; dropout is
    CUDA's fused kernel (bool mask); the output and the (discarded) weights go back to the input
    dtype. A bool mask has become an additive mask of the input dtype in the dispatcher."""
    origin = q.dtype
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        additive = torch.zeros(attn_mask.shape, dtype=origin, device=q.device)
        attn_mask = additive.masked_fill_(attn_mask.logical_not(), float("-inf"))
    if origin in (torch.float16, torch.bfloat16):
        q, k, v = q.float(), k.float(), v.float()
    L, S = q.shape[-2], k.shape[-2]
    sf = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    q = q * sf
    if is_causal:
        causal = torch.ones(L, S, dtype=torch.bool, device=q.device).tril()
        attn_mask = torch.zeros(L, S, dtype=q.dtype, device=q.device).masked_fill_(causal.logical_not(), float("-inf"))
        del causal
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(rep, dim=-3)
        v = v.repeat_interleave(rep, dim=-3)
    attn = q @ (k.transpose(-2, -1) * sf)
    if attn_mask is not None:
        attn.add_(attn_mask)
    attn = torch.ops.aten._safe_softmax(attn, -1)
    if dropout_p > 0:
        attn = torch.native_dropout(attn, dropout_p, True)[0]
    weights = attn.to(origin)  # the second output, made first (GCC evaluates make_tuple's arguments right to left)
    out = (attn @ v).to(origin)
    del weights
    return out


def cuda_sdpa(rules: CudaRules, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    q, k, v = query, key, value   # torch's own argument names: diffusers' attention dispatch passes them by keyword
    backend = sdpa_backend(q, k, attn_mask, dropout_p, enable_gqa, rules.gpu, v)
    rules.attention_calls.append(AttentionCall(backend, tuple(q.shape), str(q.dtype).replace("torch.", ""), dropout_p > 0))
    ring = getattr(rules.fused_attention, "refuse", None)    # context parallel's ring attention (step/parallel/cp.py)
    if ring is not None:
        ring(backend, attn_mask, dropout_p, is_causal)
    if backend == "math":
        return _math_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if attn_mask is not None and attn_mask.dtype != torch.bool and attn_mask.dtype != q.dtype:
        attn_mask = attn_mask.to(q.dtype)
    out = (rules.fused_attention or FusedAttention).apply(q, k, v, attn_mask, backend)
    if rules.on_attention is not None:   # context parallel's ring: one kernel call a ring step (step/parallel/cp.py)
        for _ in range(getattr(rules.fused_attention, "ring_steps", 1)):
            rules.on_attention(backend, q, k, v, is_causal, out, dropout=dropout_p > 0)
    return out


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
            elif name in SET_OPT_DTYPE:
                # an absent dtype and an explicit dtype=None are the same to CUDA's policy
                # (F.softmax passes dtype=None down): BERT's eager softmax of fp16 scores is fp32 on CUDA
                if kwargs.get("dtype") is None and not any(isinstance(a, torch.dtype) for a in args) and _first_half(args):
                    kwargs = {**kwargs, "dtype": torch.float32}
            elif func is F.cross_entropy:
                with torch._C._DisableAutocast():
                    return _cross_entropy_decomposed(*args, **kwargs)
            elif func is torch.autograd.grad and self.rules.compile_trace:
                # AOTAutograd traces the backward under the forward's autocast (functorch config
                # backward_pass_autocast="same_as_forward"): its matmuls are cast as CUDA's would be
                return self._call(func, name, args, kwargs)
            with torch._C._DisableAutocast():
                return self._call(func, name, args, kwargs)
        return self._call(func, name, args, kwargs)

    def _call(self, func, name, args, kwargs):
        if id(func) not in _SPECIAL_IDS and name not in _SPECIAL_NAMES:    # most calls: as CPU runs them
            return func(*args, **kwargs)
        if func is torch.rand and _host_scalar_draw(args, kwargs):
            return _real_host_draw(func, args, kwargs)
        if name in ("__ge__", "ge", "nonzero") and args and getattr(args[0], KNOWN, None):
            return _known_values(func, name, args, kwargs)
        if func is F.scaled_dot_product_attention:
            return cuda_sdpa(self.rules, *args, **kwargs)
        if func is F.multi_head_attention_forward:
            return _inside_mode(self, func, args, kwargs)
        if func is torch._foreach_norm:
            return _cuda_foreach_norm(func, args, kwargs)
        if func is F.dropout or func is torch.dropout:
            return _cuda_dropout(*args, **kwargs)
        if func is torch.arange and constants_on():     # a VLM batch's index arithmetic (models/vlm.py)
            return constant_arange(func, args, kwargs)
        if func is torch.tensor and constants_on():
            return constant_tensor(func, args, kwargs)
        if func is torch._grouped_mm and _looped_grouped_mm(args, kwargs):
            return LoopedGroupedMM.apply(args[0], args[1], args[2] if len(args) > 2 else kwargs.get("offs"))
        if name in ("softmax", "log_softmax"):
            out = _half_to_float_softmax(name, args, kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


# The calls _call rewrites (by identity, then by name): any other goes straight through.
_SPECIAL_IDS = frozenset(id(f) for f in (
    torch.rand, F.scaled_dot_product_attention, F.multi_head_attention_forward, torch._foreach_norm, F.dropout,
    torch.dropout, torch.arange, torch.tensor, torch._grouped_mm))
_SPECIAL_NAMES = frozenset(("__ge__", "ge", "nonzero", "softmax", "log_softmax"))


def _looped_grouped_mm(args, kwargs) -> bool:
    """A ``torch._grouped_mm(a, b, offs)`` call CUDA runs as its fallback loop: operands that are not
    bf16 (fp32 weights, or fp16), no bias, no out_dtype (transformers' experts pass neither)."""
    if len(args) < 2 or len(args) > 3 or any(v is not None for k, v in kwargs.items() if k != "offs"):
        return False
    a, b = args[0], args[1]
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and (a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16) and a.dtype == b.dtype)


class LoopedGroupedMM(torch.autograd.Function):
    """``torch._grouped_mm`` of fp32/fp16 operands as CUDA runs it (torch 2.9-2.13,
    aten/src/ATen/native/cuda/GroupedBlas.cpp ``_grouped_mm_cuda``): the CUTLASS kernel takes bf16
    only, every other dtype goes to ``_grouped_mm_fallback`` (GroupedMMUtils.h), which copies ``offs``
    to the host and writes each group's ``mm_out`` into a slice of one output tensor: the output is
    the only allocation, the same (S, N) tensor the bf16 kernel makes. Autograd (GroupedMmBackward0)
    saves both operands (and offs); backward's two grouped matmuls give gradients of the operands'
    shapes (torch's meta kernel refuses these dtypes: ``Expected inputs of BF16 type``)."""

    @staticmethod
    def forward(ctx, a, b, offs=None):
        from torch._meta_registrations import _create_grouped_mm_output_tensor  # heavy: torch internals, here only

        ctx.save_for_backward(a, b, offs)
        return _create_grouped_mm_output_tensor(a, b, offs, a.dtype)

    @staticmethod
    def backward(ctx, grad):
        a, b, _ = ctx.saved_tensors
        ga = torch.empty_like(a) if ctx.needs_input_grad[0] else None
        gb = torch.empty_like(b) if ctx.needs_input_grad[1] else None
        return ga, gb, None


def _known_values(func, name, args, kwargs):
    """Data-dependent ops on a tensor whose values are known without reading them (the synthetic
    batch's class labels, :func:`memlens.models.adapt.mark_known`), answered from that: ``t >= c``
    of a non-negative t and c <= 0 is all true; ``nonzero`` of an all-true tensor is every index,
    the (numel, ndim) int64 tensor CUDA's nonzero returns for it (its cub scratch is not counted)."""
    t, known = args[0], getattr(args[0], KNOWN, None)
    if name == "nonzero":
        if known != "all_true" or kwargs or len(args) > 1:     # as_tuple=...: not the form answered here
            return func(*args, **kwargs)
        return torch.empty((t.numel(), t.dim()), dtype=torch.long, device=t.device)
    out = func(*args, **kwargs)
    other = args[1] if len(args) > 1 else kwargs.get("other")
    if known == "nonnegative" and isinstance(other, (int, float)) and not isinstance(other, bool) and other <= 0:
        mark_known(out, "all_true")
    return out


def _host_scalar_draw(args, kwargs) -> bool:
    """``torch.rand([])`` with no device: a 0-dim draw on the host, e.g. LayerDrop's per-layer coin
    (transformers' BART/Whisper up to 5.17: ``if torch.rand([]) < self.layerdrop``)."""
    size = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args
    dev = kwargs.get("device")
    return tuple(size) == () and (dev is None or torch.device(dev).type == "cpu")


def _real_host_draw(func, args, kwargs):
    """The draw as a constant: drawn for real, then made a tensor whose value the fake mode knows
    (``torch.tensor`` of a number), so the model's Python branch on it runs as it does on CUDA
    (a fake draw's value cannot be read). On CUDA it is a host tensor; here its 0-dim block is
    counted for the moment it lives (512 bytes)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily  # heavy: torch, loaded on first use
    from torch.utils._python_dispatch import _disable_current_modes  # heavy: torch, loaded on first use

    with unset_fake_temporarily(), _disable_current_modes():
        value = func(*args, **kwargs).item()
    return torch.tensor(value, dtype=kwargs.get("dtype") or torch.get_default_dtype())


def _inside_mode(mode, func, args, kwargs):
    """Run a Python torch function's body with the emulation active, so the calls inside it (the
    projections and the SDPA call of nn.MultiheadAttention, as torchvision's ViT uses it) get
    CUDA's rules too. Its own torch-function check is answered "no" for this one call (the body
    would otherwise hand itself back to the mode); the builtins it calls still dispatch here."""
    import torch.nn.functional as functional  # heavy: torch, loaded on first use

    original = functional.has_torch_function
    functional.has_torch_function = lambda *a: False
    try:
        with mode:
            return func(*args, **kwargs)
    finally:
        functional.has_torch_function = original


# multi_tensor_apply's chunk (aten/src/ATen/native/cuda/MultiTensorApply.cuh: kChunkSize)
FOREACH_CHUNK = 65536


def _cuda_foreach_norm(func, args, kwargs):
    """``torch._foreach_norm`` as CUDA's fast path allocates it (aten/src/ATen/native/cuda/
    ForeachReduceOp.cu ``_foreach_tensor_norm_cuda_impl``): a zeroed partial-sum buffer of
    ntensors x max_chunks_per_tensor opmath floats (max_chunks = ceil(largest numel / 65536))
    while the kernel runs, then one 0-dim result per tensor (the CPU path makes only the results).
    Used by ``clip_grad_norm_``: for a 128k-vocabulary embedding that buffer is megabytes."""
    tensors = args[0] if args else kwargs.get("self")
    ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    fast = (tensors and all(t.is_floating_point() and not t.is_complex() for t in tensors)
            and float(ord_) in (1.0, 2.0, math.inf) and len({t.dtype for t in tensors}) == 1)
    scratch = None
    if fast:
        chunks = max((t.numel() + FOREACH_CHUNK - 1) // FOREACH_CHUNK for t in tensors)
        scratch = torch.zeros(len(tensors) * chunks, dtype=torch.float32 if tensors[0].dtype != torch.float64 else torch.float64,
                              device=tensors[0].device)
    out = func(*args, **kwargs)
    del scratch
    return out


def _half_to_float_softmax(name: str, args, kwargs):
    """CUDA computes softmax/log_softmax of an fp16 input with dtype=float32 in one kernel
    (`half_to_float`), keeping no fp32 copy of the input; the CPU (and bf16 on CUDA) first
    converts the input (aten/src/ATen/native/SoftMax.cpp)."""
    if not args or not isinstance(args[0], torch.Tensor) or args[0].dtype != torch.float16:
        return None
    x = args[0]
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    dtype = kwargs.get("dtype")
    if dtype is None:
        dtype = next((a for a in args[2:] if isinstance(a, torch.dtype)), None)
    if dim is None or dtype != torch.float32 or not isinstance(dim, int):
        return None
    op = torch._softmax if name == "softmax" else torch._log_softmax
    return op(x, dim, True)


def _first_half(args) -> bool:
    return bool(args) and isinstance(args[0], torch.Tensor) and args[0].dtype in (torch.float16, torch.bfloat16)


def _cross_entropy_decomposed(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                              reduction="mean", label_smoothing=0.0):
    """cross_entropy under CUDA autocast. It has no policy of its own and decomposes in C++
    (aten/src/ATen/native/LossNLL.cpp) into log_softmax(x, 1, dtype=x.dtype), which keeps the
    input's half dtype because the dtype is given, and nll_loss, which is on the fp32 list and so
    copies the half log-probabilities to fp32 and keeps that copy for backward (measured on an H100:
    BERT's MLM loss holds fp16 log-probs and their fp32 copy through backward)."""
    if target.is_floating_point():  # class probabilities
        return F.cross_entropy(input.float(), target, weight, None, ignore_index, None, reduction, label_smoothing)
    lp = F.log_softmax(input, 1, dtype=input.dtype)
    lp32 = lp.float() if lp.dtype in (torch.float16, torch.bfloat16) else lp
    loss = F.nll_loss(lp32, target, weight, None, ignore_index, None, reduction)
    if label_smoothing > 0:
        smooth = -lp.sum(dim=1, dtype=torch.float32)
        loss = (1 - label_smoothing) * loss + label_smoothing * smooth.mean() / input.shape[1]
    return loss


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
