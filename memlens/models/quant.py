"""Memory-faithful stand-ins for bitsandbytes pieces (4-bit base weights, 8-bit optimizer states).

bitsandbytes needs a GPU, so the estimator models what its kernels allocate:

- NF4 weights (QLoRA): 4 bits per weight packed in uint8 (numel / 2 bytes) plus block-wise
  absmax statistics, blocks of 64 (double quantization: one uint8 per block plus one fp32 per 256
  blocks). Forward and backward dequantize the whole weight to the compute dtype for the matmul
  and free it: a transient of out x in elements per layer (bitsandbytes MatMul4Bit).
- AdamW8bit: two uint8 states per parameter for tensors of >= 4096 elements, with one fp32
  absmax per block of 256 (blockwise quantization); smaller tensors keep fp32 states.
"""
from __future__ import annotations

import torch

from ..core.errors import SpecError
from ..core.units import fmt_bytes

NF4_BLOCK = 64
DOUBLE_QUANT_BLOCK = 256
OPT8_MIN_SIZE = 4096
OPT8_BLOCK = 256


class _Dequant4bitMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, packed, absmax, out_features, in_features, compute_dtype):
        w = torch.empty(out_features, in_features, dtype=compute_dtype, device=x.device)
        out = x.to(compute_dtype) @ w.t()
        del w
        ctx.save_for_backward(packed, absmax)
        ctx.shape = (out_features, in_features, compute_dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        out_f, in_f, dt = ctx.shape
        w = torch.empty(out_f, in_f, dtype=dt, device=grad_out.device)
        grad_x = grad_out @ w
        del w
        return grad_x, None, None, None, None, None


class Linear4bitSim(torch.nn.Module):
    """A frozen linear layer stored as NF4 (what bitsandbytes.nn.Linear4bit keeps on the GPU).

    The packed weight and its absmax are buffers here (no gradient, no optimizer), but they are the
    layer's weight: bitsandbytes holds it as a uint8 ``Params4bit`` parameter (absmax in its quant
    state), so the tracker counts them as parameters (``memlens_weight_buffers``), at their storage
    dtypes: uint8 (two 4-bit weights a byte), uint8 absmax per 64 weights, fp32 per 256 blocks."""

    memlens_weight_buffers = ("weight_packed", "absmax", "absmax2")   # core.tracker.register_model: parameters
    memlens_host_call = "qlora_layer"   # bitsandbytes' Python per call, priced by the time model (timing.record)

    def __init__(self, in_features: int, out_features: int, bias: bool, compute_dtype: torch.dtype, device=None,
                 bias_dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features, self.compute_dtype = in_features, out_features, compute_dtype
        n = in_features * out_features
        blocks = (n + NF4_BLOCK - 1) // NF4_BLOCK
        self.register_buffer("weight_packed", torch.empty((n + 1) // 2, dtype=torch.uint8, device=device))
        # double-quantized absmax: uint8 per block + fp32 per 256 blocks
        self.register_buffer("absmax", torch.empty(blocks, dtype=torch.uint8, device=device))
        self.register_buffer("absmax2", torch.empty((blocks + DOUBLE_QUANT_BLOCK - 1) // DOUBLE_QUANT_BLOCK, dtype=torch.float32, device=device))
        self.bias = torch.nn.Parameter(torch.empty(out_features, dtype=bias_dtype or compute_dtype, device=device),
                                       requires_grad=False) if bias else None

    def forward(self, x):
        # bitsandbytes Linear4bit.forward: x.to(compute_dtype), bias.to(compute_dtype), matmul_4bit(...).to(inp_dtype):
        # an fp32 input (the hidden states after prepare_model_for_kbit_training's fp32 embeddings) gets an fp32 output
        inp_dtype = x.dtype
        out = _Dequant4bitMatmul.apply(x, self.weight_packed, self.absmax, self.out_features, self.in_features, self.compute_dtype)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.to(inp_dtype)


def quantized_weight_count(model) -> int:
    """The weights held packed as 4-bit (:class:`Linear4bitSim`): ``in x out`` parameters each, which
    ``model.parameters()`` does not list (they are buffers here, a uint8 ``Params4bit`` of half as many
    elements in bitsandbytes: neither is the model's parameter count)."""
    return sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, Linear4bitSim))


def packed(p) -> bool:
    """bitsandbytes' packed 4-bit weight (``Params4bit``, a uint8 parameter of half the weights' elements)."""
    return type(p).__name__ == "Params4bit"


def param_count(model) -> int:
    """The model's parameters, each 4-bit weight counted as the ``in x out`` weights it packs: the stand-ins' (buffers)
    and bitsandbytes' own (:func:`packed` parameters, whose Linear4bit keeps the layer's shape)."""
    plain = sum(p.numel() for p in model.parameters() if not packed(p))
    bnb = sum(m.in_features * m.out_features for m in model.modules()
              if type(m).__name__ == "Linear4bit" and packed(getattr(m, "weight", None)))
    return plain + bnb + quantized_weight_count(model)


def unquantized_note(model) -> str | None:
    """What bitsandbytes' 4-bit loading leaves in 16/32 bits besides embeddings, norms and lm_head: frozen weights
    that are no nn.Linear, such as the fused expert tensors of Mixtral/OLMoE-style MoE layers (an
    ``nn.Parameter`` of shape experts x out x in, which ``replace_with_bnb_linear`` does not touch)."""
    big: dict[str, int] = {}
    for mname, mod in model.named_modules():
        if isinstance(mod, (torch.nn.Linear, torch.nn.Embedding, Linear4bitSim)) or "norm" in type(mod).__name__.lower():
            continue
        for pname, p in mod.named_parameters(recurse=False):
            if not p.requires_grad and p.dim() >= 2 and p.is_floating_point():
                kind = type(mod).__name__
                big[kind] = big.get(kind, 0) + p.numel() * p.element_size()
    if not big:
        return None
    total = sum(big.values())
    what = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(big.items(), key=lambda kv: -kv[1]))
    return (f"--qlora: bitsandbytes quantizes nn.Linear layers only; {fmt_bytes(total)} of frozen weights in other "
            f"modules stay in their dtype ({what}; e.g. fused MoE experts), as they do on a GPU")


def quantize_frozen_linears(model, compute_dtype: torch.dtype, bias_dtype: torch.dtype | None = None) -> int:
    """Replace every frozen nn.Linear (LoRA base layers included, lm_head excluded) by Linear4bitSim;
    their biases in ``bias_dtype`` (None: the compute dtype; fp32 after prepare_model_for_kbit_training)."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and not child.weight.requires_grad and "lm_head" not in name:
                new = Linear4bitSim(child.in_features, child.out_features, child.bias is not None, compute_dtype, child.weight.device,
                                    bias_dtype=bias_dtype)
                setattr(parent, name, new)
                count += 1
    return count


def quantize_with_bitsandbytes(model, compute_dtype: torch.dtype) -> int:
    """On a device: every nn.Linear but the LM head replaced by bitsandbytes' ``Linear4bit`` (NF4, double
    quantization, storage uint8, compute in ``compute_dtype``), its weight quantized where it lies - what
    ``from_pretrained(quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
    bnb_4bit_use_double_quant=True))`` leaves (transformers' ``replace_with_bnb_linear`` skips the output head). LoRA
    comes after, on the 4-bit layers, as peft wraps them in a QLoRA recipe. Refused without bitsandbytes (a stand-in
    would be measured, not bitsandbytes: the simulation's stand-ins are for fake tensors)."""
    try:
        import bitsandbytes as bnb  # optional: bitsandbytes (a GPU's)
    except ImportError:
        raise SpecError("--qlora on a device needs bitsandbytes (its 4-bit layers are what is measured)",
                        hint="pip install bitsandbytes; `memlens estimate --qlora` simulates QLoRA without it") from None
    where = next(model.parameters()).device
    if where.type != "cuda":
        raise SpecError(f"--qlora builds bitsandbytes' 4-bit layers on a CUDA GPU; this model is built on {where.type}",
                        hint="profile QLoRA on a GPU (without --load-on-cpu), or `memlens estimate --qlora` simulates it")
    count = replace_linears_4bit(model, bnb, compute_dtype)
    model.is_loaded_in_4bit = True     # what peft reads to pick its bitsandbytes LoRA layers
    return count


def replace_linears_4bit(model, bnb, compute_dtype: torch.dtype) -> int:
    """:func:`quantize_with_bitsandbytes`' replacement, with the ``bnb`` module given: every nn.Linear but the output
    head a ``Linear4bit`` whose ``Params4bit`` quantizes as it moves to the layer's device. Returns how many."""
    count = 0
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear or child is head or "lm_head" in name:
                continue
            new = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                    compute_dtype=compute_dtype, compress_statistics=True, quant_type="nf4",
                                    quant_storage=torch.uint8, device="meta")
            new.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, compress_statistics=True,
                                           quant_type="nf4", quant_storage=torch.uint8)
            if child.bias is not None:
                new.bias = torch.nn.Parameter(child.bias.data, requires_grad=child.bias.requires_grad)
            setattr(parent, name, new.to(child.weight.device))   # Params4bit quantizes on its move to a GPU
            count += 1
    return count


class AdamW8bitSim(torch.optim.Optimizer):
    """AdamW with 8-bit block-wise states, as bitsandbytes.optim.AdamW8bit allocates them
    (bitsandbytes/optim/optimizer.py Optimizer2State.init_state):

    - tensors of >= 4096 elements (``min_8bit_size``): state1/state2 uint8 of the parameter's
      shape, absmax1/absmax2 fp32 of ceil(n / 256) blocks, and the two 256-entry fp32 quantization
      maps (``dynamic``, ``udynamic``) moved to the GPU once per optimizer;
    - smaller tensors, and those given ``optim_bits=32`` (``fp32_params``: the Trainer's override
      for embeddings), keep fp32 state1/state2;
    - ``paged``: ``get_state_buffer`` puts state tensors of >= 1e5 elements in CUDA managed memory
      (cudaMallocManaged), outside PyTorch's caching allocator: they are not allocated here and
      their bytes are summed in ``paged_bytes``.

    The update runs in place inside one kernel, so there are no parameter-sized temporaries.
    """

    QMAP_ENTRIES = 256
    PAGED_MIN_NUMEL = 100_000   # get_state_buffer: `not self.is_paged or p.numel() < 1e5` -> zeros_like

    def __init__(self, params, lr: float = 1e-3, paged: bool = False, fp32_params: set[int] | None = None):
        super().__init__(params, {"lr": lr})
        self.paged = paged
        self.fp32_params = fp32_params or set()
        self.paged_bytes = 0
        self._qmaps: list[torch.Tensor] = []

    def _buffer(self, p, dtype):
        if self.paged and p.numel() >= self.PAGED_MIN_NUMEL:
            self.paged_bytes += p.numel() * torch.empty((), dtype=dtype).element_size()
            return None
        return torch.zeros_like(p, dtype=dtype)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = torch.zeros((), dtype=torch.float32)   # a Python int in bitsandbytes: host
                    if p.numel() >= OPT8_MIN_SIZE and id(p) not in self.fp32_params:
                        if not self._qmaps:
                            self._qmaps = [torch.empty(self.QMAP_ENTRIES, dtype=torch.float32, device=p.device) for _ in range(2)]
                        blocks = (p.numel() + OPT8_BLOCK - 1) // OPT8_BLOCK
                        for k in ("state1", "state2"):
                            buf = self._buffer(p, torch.uint8)
                            if buf is not None:
                                st[k] = buf
                        st["qmap1"], st["qmap2"] = self._qmaps
                        st["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
                        st["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
                    else:
                        for k in ("state1", "state2"):
                            buf = self._buffer(p, torch.float32)
                            if buf is not None:
                                st[k] = buf
        return None
