"""What one aten op of the simulated step costs the GPU, in the units a timing table prices: FLOPs and a GEMM
shape for matmuls and convolutions, bytes moved (inputs read + outputs written) for everything else, nothing for
views and allocations (no kernel runs; the host still dispatches them).

Fake tensors carry every shape and dtype, so this is exact per op; only the kernel's speed comes from the table.

>>> import torch
>>> a, b = torch.empty(64, 128), torch.empty(128, 32)
>>> facts = op_facts(torch.ops.aten.mm.default, (a, b), {}, a @ b)
>>> facts.kind, facts.flops, facts.mnk, facts.nbytes
('matmul', 524288, (64, 32, 128), 57344)
"""
from __future__ import annotations

import math

from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_flatten

from .ops_kinds import (ALLOC, ATTN_BWD, ATTN_FWD, COMM, CONV, HALF_ROWS, LAYER_NORM_OPS, LAYER_NORM_WIDTHS, MATMUL, MEMORY,
                        META, SOFTMAX_OPS, SOFTMAX_WIDTHS, SYNC, VIEW)


class OpFacts(NamedTuple):
    kind: str
    flops: int = 0
    nbytes: int = 0
    mnk: tuple | None = None       # the GEMM shape a matmul / convolution is priced at (implicit GEMM for a convolution)
    dtype: str = "float32"
    seq: int = 0                   # attention: the query length (the table's axis); a collective: its group's ranks
    op: str = ""                   # the aten op's name (a memory-bound op priced at its own measured rate, if any)
    hd: int = 0                    # attention: the head dim
    causal: bool = False           # attention: a causal mask (the kernels skip the masked tiles)
    aligned: bool = True           # matmul: every operand's leading dimension on a 16-byte boundary (cuBLAS' fast path)
    out_unaligned: bool = False    # matmul: the output's own leading dimension is off (its stores, not its loads)
    dropout: bool = False          # attention: dropout on the probabilities (the kernel draws Philox numbers per score)
    gathered: int = 0              # FSDP2's all_gather_copy_in: the bytes its group's all-gather fills (seq: the ranks)
    fill: int = 0                  # bytes the op zero-fills before its own kernels (embedding_dense_backward's [V, H])
    pad: float = 1.0               # matmul: the FLOPs its tiles compute over the FLOPs asked (a grouped GEMM's last tiles)


_KIND: dict = {}
_NAME: dict = {}


def _op_name(func) -> str:
    n = _NAME.get(func)
    if n is None:
        n = _NAME[func] = func._schema.name.split("::")[-1] if hasattr(func, "_schema") else str(func)
    return n
_ALLOC_OPS = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh", "resize_"}
_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "_addmm_activation", "addmv", "mv", "_grouped_mm", "dot",
            "_scaled_mm", "_int_mm"}
_FLASH = {"_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
          "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward"}
_NO_KERNEL = {"_unsafe_view", "_reshape_alias", "_unsafe_index_put_view", "set_", "record_stream", "_has_compatible_shallow_copy_type",
              "_to_copy_view", "sym_size", "sym_stride", "sym_numel", "is_same_size", "_nested_view_from_buffer"}
_COMM = {"all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_reduce_", "wait_tensor", "_allgather_base_",
         "allgather_", "allreduce_", "reduce_scatter_", "_reduce_scatter_base_", "broadcast_", "all_to_all_single",
         "allgather_into_tensor_coalesced_", "reduce_scatter_tensor_coalesced", "all_gather_into_tensor_coalesced"}
# functional collectives -> the NCCL pattern they run (the table's all_reduce / all_gather rows; reduce-scatter and
# all-to-all move (n-1)/n of the buffer per rank, as all-gather does)
_FUNCOL = {"all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
           "reduce_scatter_tensor": "all_gather", "reduce_scatter_tensor_coalesced": "all_gather",
           "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce", "all_to_all_single": "all_gather"}
_SYNC = {"_local_scalar_dense", "item", "nonzero", "equal", "is_nonzero"}


def kind_of(func) -> str:
    """The op's pricing class, cached per overload: a view (its outputs alias an input, nothing written), an
    allocation (empty*), a host sync, a matmul, a convolution, attention, or a memory-bound kernel."""
    k = _KIND.get(func)
    if k is None:
        k = _KIND[func] = _classify(func)
    return k


def _classify(func) -> str:
    name = func._schema.name.split("::")[-1] if hasattr(func, "_schema") else str(func)
    if hasattr(func, "_schema") and func._schema.name.startswith("prim::"):
        return META
    if hasattr(func, "_schema") and func._schema.name.startswith("_c10d_functional::") and name in _FUNCOL:
        return COMM
    if name in _NO_KERNEL or name in _COMM:   # collectives: priced per step from the bytes they move (timing.step)
        return VIEW
    if name in _ALLOC_OPS:
        return ALLOC
    if name in _SYNC:
        return SYNC
    if name in _MATMULS:
        return MATMUL
    if name in ("convolution", "convolution_backward", "_convolution", "cudnn_convolution"):
        return CONV
    if name in _FLASH:
        return ATTN_FWD
    if name.endswith("attention_backward") and name.startswith("_"):
        return ATTN_BWD
    schema = getattr(func, "_schema", None)
    if schema is not None and (schema.name.startswith("prim::") or not any("Tensor" in str(r.type) for r in schema.returns)):
        writes = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        return MEMORY if writes else VIEW   # in-place foreach ops return nothing; prim::device, sym_size: metadata
    if schema is not None and schema.returns and all(
            r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
        return VIEW      # view, transpose, expand, detach, _unsafe_view, split (outputs alias an input)
    return MEMORY


def _nbytes(t: torch.Tensor) -> int:
    """Bytes a kernel touches for ``t``: its elements (a broadcast operand reaches the kernel unexpanded)."""
    return t.numel() * t.element_size()


def _tensors(x) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    if type(x) in (tuple, list):
        return [t for t in x if isinstance(t, torch.Tensor)]
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


def _flat_tensors(args, kwargs) -> list:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif type(a) in (list, tuple):
            out.extend(t for t in a if isinstance(t, torch.Tensor))
    if kwargs:
        out.extend(t for t in tree_flatten(kwargs)[0] if isinstance(t, torch.Tensor))
    return out


_DTYPE_NAMES: dict = {}


def _dtype(t) -> str:
    d = t.dtype
    name = _DTYPE_NAMES.get(d)
    if name is None:
        name = _DTYPE_NAMES[d] = str(d).replace("torch.", "")
    return name


_REGISTRY: list = []
_ATEN = torch.ops.aten
_GEMM_OPERANDS = {_ATEN.mm: (0, 2), _ATEN.addmm: (1, 2), _ATEN.bmm: (0, 3), _ATEN.baddbmm: (1, 3)}   # (first operand, dims)


def _gemm_flops(func, args) -> int | None:
    """torch's flop formulas for the plain matmuls (torch.utils.flop_counter: mm, addmm, bmm, baddbmm: 2 x M x N x K
    per batch), read from the operands' shapes directly: the registry's wrapper maps every argument through a pytree
    first, a few percent of a simulation. None for any other op, or operands not as those formulas read them."""
    i, dims = _GEMM_OPERANDS.get(getattr(func, "_overloadpacket", None), (None, 0))
    if i is None or len(args) < i + 2:
        return None
    a, b = args[i], args[i + 1]
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dim() != dims or b.dim() != dims:
        return None
    if a.shape[-1] != b.shape[-2] or (dims == 3 and a.shape[0] != b.shape[0]):
        return None
    return (a.shape[0] if dims == 3 else 1) * a.shape[-2] * b.shape[-1] * 2 * a.shape[-1]


def _flops(func, args, kwargs, out) -> int:
    fast = _gemm_flops(func, args)
    if fast is not None:
        return int(fast)
    if not _REGISTRY:
        from torch.utils.flop_counter import flop_registry  # heavy: torch internals, loaded on first use

        _REGISTRY.append(flop_registry)
    f = _REGISTRY[0].get(getattr(func, "_overloadpacket", None))
    if f is None:
        return 0
    try:
        return int(f(*args, **(kwargs or {}), out_val=out))
    except Exception:  # noqa: BLE001 - a formula that does not take this overload's arguments: price by bytes
        return 0


def _gemm_shape(func, args, flops: int) -> tuple[int, int, int]:
    """(M, N, K) of a matmul (batched: M x batch), read from its operands."""
    name = func._schema.name.split("::")[-1]
    a, b = (args[1], args[2]) if name in ("addmm", "baddbmm", "addbmm", "_addmm_activation", "addmv") else (args[0], args[1])
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dim() == 0 or b.dim() == 0:
        return 1, 1, 1
    k = a.shape[-1]
    n = b.shape[-1] if b.dim() >= 2 else 1
    m = max(1, flops // max(1, 2 * n * k)) if flops else a.numel() // max(1, k)
    return int(m), int(n), int(k)


GROUP_TILE_M = 128   # rows of a grouped GEMM's tile: each group's rows end in a partly empty tile (half one, expected)


def _grouped_mm_facts(args, kwargs, out: torch.Tensor, nbytes: int, dtype: str) -> OpFacts:
    """``torch._grouped_mm`` (a mixture of experts' layers: Hugging Face's ``grouped_mm`` experts, torchtitan): one
    GEMM per group (expert) - ``[T, K] x [G, K, N]`` with offsets (each token's rows in its expert's group; forward and
    the inputs' gradient), ``[G, M, K] x [G, K, N]``, or ``[M, T] x [T, N]`` split along T (the weights' gradient, out
    ``[G, M, N]``). 2 x out x K FLOPs, K the length reduced per group (torch's flop counter has no formula: priced by
    its bytes before, 4.0 ms where OLMoE's 32 forward grouped GEMMs ran 7.0 on an H200). The kernel schedules every
    group's tiles over the GPU together, so it runs at about a dense GEMM's rate over all the rows (``mnk``), less
    what a table measures (``op_ratio["_grouped_mm"]``); with offsets, each group's last tile is half empty on average
    (``pad``: the rows computed over the rows asked, at ``GROUP_TILE_M``-row tiles)."""
    a, b = args[0], args[1]
    offs = args[2] if len(args) > 2 else (kwargs or {}).get("offs")
    groups = int(offs.numel()) if isinstance(offs, torch.Tensor) else int(a.shape[0]) if a.dim() == 3 else 1
    split_k = a.dim() == 2 and b.dim() == 2
    k = max(1, int(a.shape[-1]) // (groups if split_k else 1))
    n = int(out.shape[-1])
    rows = max(1, out.numel() // max(1, n))          # every group's output rows together
    pad = 1.0
    if isinstance(offs, torch.Tensor) and a.dim() == 2 and b.dim() == 3:
        pad = (rows + groups * GROUP_TILE_M / 2) / rows
    return OpFacts(MATMUL, 2 * out.numel() * k, nbytes, (rows, n, k), dtype, aligned=_aligned(a, b, out), pad=pad,
                   op="_grouped_mm")


# (weight, groups, transposed) argument positions per convolution op (cudnn_convolution has no transposed flag)
_CONV_ARGS = {"convolution": (1, 8, 6), "_convolution": (1, 8, 6), "cudnn_convolution": (1, 5, None),
              "convolution_backward": (2, 9, 7)}
DEPTHWISE = "/depthwise"
NHWC = "/nhwc"     # a depthwise convolution over a channels-last input: cuDNN's NHWC kernels, 3-4x its NCHW ones


def _conv_facts(name: str, args, outs: list, nbytes: int, dtype: str) -> OpFacts:
    """A convolution as the implicit GEMM cuDNN runs: per group M = the output's positions (batch x spatial), N = its
    output channels / groups, K = input channels / groups x kernel area; FLOPs 2 M N K x groups, twice that backward
    where both gradients are asked (the input's and the weight's: each a convolution of the forward's size; torch's
    flop counter prices the weight's gradient of a grouped convolution as if ungrouped: a depthwise 7 x 7 of
    ConvNeXt-T 97x its FLOPs). A depthwise convolution (one input channel a group) is no GEMM: cuDNN runs it on CUDA
    cores, far under a GEMM's rate and at a pace set by the input's layout - ``convolution/depthwise`` over NCHW,
    ``.../nhwc`` over a channels-last input (Hugging Face's ConvNeXt permutes its blocks' outputs back so): 666 and 195
    us forward, 2,225 and 532 backward, for ConvNeXt-T's first stage on an H200 (bench/gpu_depthwise_probe.py), where a
    copy of the input takes 22 - memory-bound ops with rates a table measures."""
    wi, gi, ti = _CONV_ARGS.get(name, (1, 8, 6))
    x = args[1] if name == "convolution_backward" else args[0]
    w = args[wi]
    groups = args[gi] if len(args) > gi and isinstance(args[gi], int) else 1
    transposed = bool(args[ti]) if ti is not None and len(args) > ti else False
    kernel = int(w.numel() // max(1, w.shape[0]))          # w.shape[1:] multiplied: channels a group x kernel area
    if transposed:   # weight [C_in, C_out / g, kh, kw]: each input position scatters into C_out / g x kernel outputs
        area = kernel // max(1, int(w.shape[1]))
        m, n, k = int(x.numel() // max(1, x.shape[1])), int(w.shape[1]) * area, int(w.shape[0]) // max(1, groups)
    else:            # weight [C_out, C_in / g, kh, kw]; the output (the gradient of it, backward) [N, C_out, ...]
        y = args[0] if name == "convolution_backward" else outs[0]
        m, n, k = int(y.numel() // max(1, y.shape[1])), int(w.shape[0]) // max(1, groups), kernel
    passes = 1
    if name == "convolution_backward":
        mask = args[10] if len(args) > 10 else (True, True, True)
        passes = int(bool(mask[0])) + int(bool(mask[1]))
    if not transposed and groups > 1 and int(w.shape[1]) == 1:
        nhwc = x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
        return OpFacts(MEMORY, 0, nbytes, None, dtype,
                       op=name.lstrip("_").replace("cudnn_", "") + DEPTHWISE + (NHWC if nhwc else ""))
    return OpFacts(CONV, 2 * m * n * k * groups * passes, nbytes, (max(1, m), max(1, n), max(1, k)), dtype)


def _group_size(args) -> int:
    """The ranks of a functional collective's group: its ``group_size`` argument, else its group's size by name."""
    for a in args[1:]:
        if isinstance(a, int) and not isinstance(a, bool):
            return a
    name = next((a for a in args[1:] if isinstance(a, str) and a not in ("sum", "avg", "max", "min", "product")), None)
    if name is not None:
        try:
            from torch.distributed.distributed_c10d import _resolve_process_group  # heavy: torch.distributed

            return int(_resolve_process_group(name).size())
        except (RuntimeError, ValueError, KeyError, ImportError):
            return 0
    return 0


_BINARY = {"mul", "add", "sub", "div", "mul_", "add_", "sub_", "div_", "where", "maximum", "minimum", "addcmul", "lerp"}


def _layout(ins: list, binary: bool) -> str:
    """How a memory-bound op reads its inputs, when not plainly: ``/heads`` (an input is read in short runs: attention
    heads transposed out of a projection, RoPE's halves of them), ``/strided`` (another non-contiguous view: a
    transpose, half rows - the kernel gathers with strides) or, for an elementwise binary op, ``/bcast`` (an
    input is broadcast: a norm's weight, RoPE's cos/sin - one operand re-read per row) or ``/mixed`` (operands of two
    float dtypes: autocast's fp32 residual stream plus a bf16 projection's output - TensorIterator casts each element
    as it loads it, without the vectorized loads of one dtype). A table measures such layouts' rates apart
    (memlens.measure.calibrate) and prices the op by its own name where it has none."""
    if len(ins) < 1:
        return ""
    try:
        strided = [t for t in ins if t.dim() > 1 and not t.is_contiguous()]
        if strided:
            return "/heads" if any(_short_runs(t) for t in strided) else "/strided"
        if binary and len(ins) > 1 and len({t.numel() for t in ins if t.dim() > 0}) > 1:
            return "/rows" if _per_row(ins) else "/bcast"
        if binary and len({t.dtype for t in ins if t.dim() > 0 and t.is_floating_point()}) > 1:
            return "/mixed"      # same-shape operands (as measured); a broadcast one keeps its broadcast's rate
    except RuntimeError:      # a tensor without strides (sparse, nested): as a plain read
        return ""
    return ""


def _per_row(ins: list) -> bool:
    """A binary op whose smaller operand is one value per row of the larger (``[..., 1]``: RMSNorm's ``x * rsqrt(var)``,
    a softmax's or loss's per-row scale): each row reads its value once, where a ``[H]`` operand (a norm's weight) is
    read again along every row; calibrate measured 0.45 and 0.67 of a copy on an H200 (`/bcast` and `/rows`)."""
    big = max(ins, key=lambda t: t.numel())
    small = [t for t in ins if t is not big and 0 < t.dim() and t.numel() < big.numel()]
    return bool(small) and all(t.shape[-1] == 1 and big.shape[-1] > 1 for t in small)


HEAD_RUN = 64   # a contiguous run of this many elements or fewer: a head (dim <= 64) or RoPE's half of one


def _short_runs(t: torch.Tensor) -> bool:
    """A view read in short contiguous runs with a long stride between them: attention's heads transposed out of a
    projection (``view(B, L, H, D).transpose(1, 2)``: runs of D elements) and RoPE's halves of them (D / 2). The
    non-contiguous kernels (cat's and copy's TensorIterator path) run far below a copy's rate on them: GPT-2's
    key/value cat (runs of 64) ran 0.99 ms for 24 calls on an H200, priced 0.27 at the rate of rows thousands wide."""
    return t.stride(-1) == 1 and t.shape[-1] <= HEAD_RUN and t.stride(-2) != t.shape[-1]


def _aligned(*ts) -> bool:
    """Whether every matrix's leading dimension and offset fall on 16 bytes: cuBLAS(Lt)'s tensor-core kernels on
    Hopper load tiles by TMA, which needs it; a matrix with, say, GPT-2's 50,257-wide vocabulary as its leading
    dimension takes the slower unaligned kernels (the table's ``matmul_unaligned``)."""
    for t in ts:
        if not isinstance(t, torch.Tensor) or t.dim() < 2:
            continue
        el = t.element_size()
        sr, sc = t.stride()[-2], t.stride()[-1]
        ld = sr if sc == 1 else sc if sr == 1 else 0
        if (ld * el) % 16 or (t.storage_offset() * el) % 16:
            return False
    return True


_BARE = {VIEW: OpFacts(VIEW), ALLOC: OpFacts(ALLOC), SYNC: OpFacts(SYNC), META: OpFacts(META)}


def op_facts(func, args, kwargs, out) -> OpFacts:
    """The cost facts of one aten op (see the module docstring)."""
    kind = _KIND.get(func) or kind_of(func)
    bare = _BARE.get(kind)
    if bare is not None:
        return bare
    ins = _flat_tensors(args, kwargs)
    outs = _tensors(out) if out is not None else []
    nbytes = sum(_nbytes(t) for t in ins) + sum(_nbytes(t) for t in outs if not any(t is i for i in ins))
    dtype = _dtype(ins[0]) if ins else "float32"
    if kind == COMM:
        name = _op_name(func)
        full = max(sum(_nbytes(t) for t in ins), sum(_nbytes(t) for t in outs))   # the whole buffer (gathered side)
        return OpFacts(COMM, 0, full, None, dtype, _group_size(args), op=_FUNCOL[name])
    if kind == MATMUL:
        name = _op_name(func)
        if name == "_grouped_mm" and outs:
            return _grouped_mm_facts(args, kwargs, outs[0], nbytes, dtype)
        fl = _flops(func, args, kwargs, out)
        mats = (args[1], args[2]) if name in ("addmm", "baddbmm", "addbmm", "_addmm_activation") else tuple(args[:2])
        out_ok = _aligned(*outs[:1])
        return OpFacts(MATMUL, fl, nbytes, _gemm_shape(func, args, fl), dtype, aligned=out_ok and _aligned(*mats),
                       out_unaligned=not out_ok)
    if kind == CONV:
        return _conv_facts(_op_name(func), args, outs, nbytes, dtype)
    if kind in (ATTN_FWD, ATTN_BWD):
        q = ins[0] if kind == ATTN_FWD else ins[1]
        return OpFacts(kind, _flops(func, args, kwargs, out), nbytes, None, _dtype(q), int(q.shape[-2]),
                       hd=int(q.shape[-1]), causal=bool(kwargs.get("is_causal")) if kwargs else False)
    name = _op_name(func)
    if name == "all_gather_copy_in":
        return _copy_in_facts(args, dtype, nbytes)
    if name == "embedding_dense_backward" and outs:
        # a zero-fill of the whole [V, H] gradient (at::zeros), then kernels over the N looked-up rows (sort the
        # indices, sum each index's rows, write them): the fill at its own rate, the rest by the rows' bytes
        fill = _nbytes(outs[0])
        return OpFacts(MEMORY, 0, nbytes - fill, None, dtype, op=EMBEDDING_ROWS, fill=fill)
    if name in _BATCH_NORM and ins and ins[0].dim() > 2:
        return OpFacts(MEMORY, 0, nbytes, None, dtype, op=name + _spatial(ins[0]) + _fp32(ins[0]))
    if name in LAYER_NORM_OPS and ins:
        return OpFacts(MEMORY, 0, nbytes, None, dtype, op=name + _norm_width(ins[0]) + _fp32(ins[0]))
    if name in _NORMS and ins:
        return OpFacts(MEMORY, 0, nbytes, None, dtype, op=name + _fp32(ins[0]))
    if name in SOFTMAX_OPS and ins:
        return OpFacts(MEMORY, 0, nbytes, None, dtype, op=name + _row_width(name, args, ins[0]))
    if name in _CASTS and _upcast(name, ins, outs):
        return OpFacts(MEMORY, 0, nbytes, None, dtype, op=name + UPCAST)
    if name == "cat" and sum(1 for t in ins if t.numel()) == 1:
        return OpFacts(MEMORY, 0, nbytes, None, dtype, op=CAT_ONE)
    if name in _INTO_ZEROS and ins and outs:
        # zeros of the input's shape (a kernel of its own), then the gradient copied into the slice: its bytes twice
        return OpFacts(MEMORY, 0, 2 * _nbytes(ins[0]), None, dtype, op=name, fill=_nbytes(outs[0]))
    return OpFacts(MEMORY, 0, nbytes, None, dtype, op=name + _layout(ins, name in _BINARY))


# A copy that widens 16-bit floats to fp32 (``x.float()``, a norm's or softmax's upcast, autocast's fp32 ops, a loss's
# logits) runs at about half the rate of the narrowing one at the same bytes: 1.93 / 2.10 TB/s against 3.73 / 4.32 for 16M
# / 128M elements on an H200 (bench/gpu_bandwidth_probe.py). A table measures it apart (``_to_copy/up``); the layout of
# its input is not told apart (an upcast is priced at the upcast's rate whatever it reads).
UPCAST = "/up"
_CASTS = frozenset({"_to_copy", "copy_"})
_NARROW = (torch.bfloat16, torch.float16)


def _upcast(name: str, ins: list, outs: list) -> bool:
    src = ins[1] if name == "copy_" and len(ins) > 1 else ins[0] if ins else None
    return src is not None and bool(outs) and src.dtype in _NARROW and outs[0].dtype == torch.float32


# A cat of one non-empty tensor (and empty ones): Hugging Face's DynamicCache.update in training, each layer's keys and
# values cat onto an empty cache (torch.cat([torch.tensor([]), k], dim=-2)). CUDA's cat kernel runs it at ~670 GB/s
# whatever the input's layout, a fifth of a copy (GPT-2's [8, 12, 1024, 64]: 37.6 us contiguous, 38.1 as heads, where a
# copy takes 7.1; bench/results/raw/bandwidth_probe/cat_probe_h200.json): a table measures it apart (``cat/one``).
CAT_ONE = "cat/one"

# The backward of a slice or a select (RoPE's halves of each head, ``x[..., :d/2]``): at::zeros of the input's shape,
# then the gradient copied into that view - two kernels on CUDA (Llama-1B's 32 per step: the fills 0.19 ms and the
# copies into half rows 0.43 ms on an H200, priced 0.17 as one pass over the bytes before). The fill at fill_'s rate,
# the copy at the op's own where a table measured it.
_INTO_ZEROS = frozenset({"slice_backward", "select_backward"})

# embedding_dense_backward's work past its zero-fill, priced by the rows it reads (the gradient's N x H and the indices);
# calibrate measures it at EMBEDDING_CAL (N, H, V, bf16) and takes the fill's time off (memlens.measure.calibrate)
EMBEDDING_ROWS = "embedding_dense_backward/rows"
EMBEDDING_CAL = (8192, 2048, 32768)

_BATCH_NORM = frozenset({"native_batch_norm", "native_batch_norm_backward", "_native_batch_norm_legit",
                         "_native_batch_norm_legit_functional", "cudnn_batch_norm", "cudnn_batch_norm_backward"})
# the spatial sizes a table measures batch norm at (ResNet-50's stages at 224 px: 112^2 ... 7^2)
BN_SPATIAL = (12544, 3136, 784, 196, 49)


# Layer, group and batch norm: a table measures them over 16-bit inputs and over fp32 ones (``/fp32``: autocast runs
# layer and group norm in fp32, and fp32 training runs every norm so). Their kernels reduce rows or channels, so their
# time does not follow their bytes: ResNet-50's fp32 batch norms ran 3.6 ms forward on an H200 where the bf16 rate over
# their bytes priced 10.4. Layer norm's rate moves with its rows' width as well (a block or warp a row): Swin-T's
# 96-wide fp32 rows ran 2.45 ms forward where a 2,048-wide case priced 0.71, GPT-2's 768-wide ones 0.21 where it priced
# 0.09 - measured at ``LAYER_NORM_WIDTHS``, priced at the nearest (``native_layer_norm/w768/fp32``).
_NORMS = frozenset({"native_group_norm", "native_group_norm_backward"})
FP32 = "/fp32"


def _nearest(value: int, measured: tuple) -> int:
    """The measured size nearest ``value`` on a log scale (a table's widths and spatial sizes)."""
    return min(measured, key=lambda s: abs(math.log(max(value, 1) / s)))


def _norm_width(x: torch.Tensor) -> str:
    """``/w<W>``: the measured layer-norm width nearest ``x``'s last dimension (the normalized one, as Hugging Face's
    and timm's layer norms run it)."""
    return "/w%d" % _nearest(int(x.shape[-1]) if x.dim() else 1, LAYER_NORM_WIDTHS)


def _fp32(x: torch.Tensor) -> str:
    return FP32 if x.dtype == torch.float32 else ""


def _spatial(x: torch.Tensor) -> str:
    """``/hw<S>``: batch norm's per-channel statistics reduce N runs of H x W contiguous elements (NCHW), so its
    rate falls as the runs shorten (ResNet-50 on an H200: 5.96 ms forward, 8.94 backward for what one 28 x 28 shape
    priced at 4.5 and 4.4); S is the measured spatial size nearest this input's (log scale)."""
    hw = 1
    for d in x.shape[2:]:
        hw *= int(d)
    return "/hw%d" % _nearest(hw, BN_SPATIAL)


# Softmax and log-softmax (and their backwards) over the last dimension: CUDA runs rows of up to 1,024 elements with a
# warp each, longer ones with a block per row that reads its row two or three times (max, sum, write), from shared
# memory while the row fits there and from L2 / HBM past it, so the rate per byte moves with the row's width and
# dtype: ``_log_softmax`` over fp32 rows ran 0.96 of a copy at 1,024 wide, 0.62 at 32,768 and 0.48 from 65,536 on an
# H200, over bf16 rows 0.36 at 4,096 and 0.69 at 32,768 (bench/gpu_softmax_rows.py). A table measures each op at
# these widths (the attention scores' key lengths and the vocabularies of the common tokenizers: GPT-2's 50,257,
# Llama-3's 128,256 nearest 131,072) in fp32 and in a 16-bit type: ``_log_softmax/w50257`` and
# ``_log_softmax/w50257/16bit`` (the widths: memlens.estimator.timing.ops_kinds); an op over another width is priced
# at the nearest (log scale), over another dimension at the op's own rate.


def _row_width(name: str, args, x: torch.Tensor) -> str:
    """``/w<W>`` (fp32) or ``/w<W>/16bit``: the measured width nearest ``x``'s rows, when the op runs over the last
    dimension (``dim`` is the second argument forward, the third backward); else nothing (the op's own rate)."""
    pos = 1 if name in ("_softmax", "_log_softmax") else 2
    try:
        dim = int(args[pos])
        if x.dim() < 1 or dim % x.dim() != x.dim() - 1:
            return ""
        width = int(x.shape[-1])
    except (IndexError, TypeError, ValueError, RuntimeError):
        return ""
    return "/w%d" % _nearest(width, SOFTMAX_WIDTHS) + (HALF_ROWS if x.element_size() == 2 else "")


def _copy_in_facts(args, dtype: str, nbytes: int) -> OpFacts:
    """FSDP2's ``fsdp::all_gather_copy_in(inputs, all_gather_output, split_sizes, input_numel, rank)``
    (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py): a ``_foreach_copy_`` of this rank's shards into its
    slice of the all-gather buffer, priced by the bytes of its arguments and outputs as any memory-bound op (the
    multi-tensor copy runs at about half a copy's rate: 1.19 ms measured for Llama-3.2-1B's 17 groups on an H200, 1.19
    priced so); the buffer, ``ranks x input_numel`` elements, is what the all-gather that follows fills (``gathered``,
    over ``seq`` ranks)."""
    out = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else None
    numel = args[3] if len(args) > 3 and isinstance(args[3], int) else 0
    if out is None or not numel:
        return OpFacts(MEMORY, 0, nbytes, None, dtype, op="all_gather_copy_in")
    el = out.element_size()
    return OpFacts(MEMORY, 0, nbytes, None, dtype, seq=int(out.numel() // numel), op="all_gather_copy_in",
                   gathered=int(out.numel() * el))


def attention_facts(q: Any, k: Any, v: Any, causal: bool, backward: bool, dropout: bool = False) -> OpFacts:
    """A fused SDPA kernel (flash / memory-efficient / cuDNN) the simulation emulates without its arithmetic
    (memlens.estimator.cuda_rules.FusedAttention): 4 B H L S D FLOPs forward (QK^T and PV), 2.5x that backward
    (dQ, dK, dV and the recomputed scores: FlashAttention-2's 5 matmuls against 2), halved under a causal mask,
    whose masked tiles the kernels skip (FlashAttention-2 paper, section 3.1.1)."""
    B, H, L, D = q.shape
    S, Dv = k.shape[-2], v.shape[-1]
    fl = 2 * B * H * L * S * (D + Dv)
    if backward:
        fl = int(fl * 2.5)
    if causal and L == S:
        fl //= 2
    el = q.element_size()
    io = (q.numel() + k.numel() * H // max(1, k.shape[1]) + v.numel() * H // max(1, v.shape[1]) + B * H * L * Dv) * el
    return OpFacts(ATTN_BWD if backward else ATTN_FWD, int(fl), int(io * (2 if backward else 1)), None, _dtype(q), int(L),
                   hd=int(D), causal=bool(causal and L == S), dropout=bool(dropout))
