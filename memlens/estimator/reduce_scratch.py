"""The scratch a CUDA reduction takes through the caching allocator (aten/src/ATen/native/cuda/Reduce.cuh).

``gpu_reduce_kernel`` (sum, mean, ...) splits a long reduction across thread blocks when each output has many inputs
and there are few outputs: the blocks write partial results to a staging buffer in global memory
(``global_memory_size``) and count themselves in semaphores (``semaphore_size``), both allocated from the caching
allocator before the launch and freed when the call returns. The common case in training is a bias gradient: autograd
sums ``grad_output`` over the tokens (``addmm``'s or ``add``'s backward), e.g. GPT-2 medium's MLP up-projection, 1,024
tokens x 4,096 outputs in fp32: a 32 MiB buffer, made and freed at once, on every layer, in every backward (measured on
an H100: bench/results/zero1_probe.md). It never holds the peak of a step that peaks elsewhere, but it takes a
block of the large pool at that moment, and so decides where later tensors land.

:func:`global_reduce_bytes` follows ``setReduceConfig`` (the launch geometry) for a reduction of one input over some
dims, with TensorIterator's reordering (reduced dims first, then by stride) and coalescing of the dims.

>>> global_reduce_bytes((1024, 4096), (4096, 1), (0,), 4, sm_count=132, max_threads_per_sm=2048)
(33554432, 128)
>>> global_reduce_bytes((1024, 1024), (1024, 1), (0,), 4, sm_count=132, max_threads_per_sm=2048)
(8388608, 32)
>>> global_reduce_bytes((2, 512, 1024), (524288, 1024, 1), (2,), 4, sm_count=132, max_threads_per_sm=2048)
(0, 0)
"""
from __future__ import annotations

from typing import NamedTuple

MAX_NUM_THREADS = 512      # mnt_wrapper<T>::MAX_NUM_THREADS (256 for complex double, not modelled)
WARP = 32
INPUT_VEC = 4              # ReduceConfig::input_vec_size
MIN_VALUES_PER_THREAD, MAX_VALUES_PER_THREAD = 16, 256


def _div_up(a: int, b: int) -> int:
    return (a + b - 1) // b


def _last_pow2(n: int) -> int:
    """floor(log2(n)) as a power of two, at least 1 (Reduce.cuh ``last_pow2``)."""
    return max(1, 1 << (max(n, 1).bit_length() - 1))


def _iterator_dims(shape, strides, reduced: set[int]) -> list[tuple[int, int, bool]]:
    """TensorIterator's dims for the reduction, fastest first: (size, input stride, reduced), size-1 dims dropped,
    reduced dims first (the output's zero strides), then by stride; adjacent dims coalesced where both operands allow."""
    kept = [d for d in range(len(shape)) if d not in reduced and shape[d] > 1]
    out_stride, s = {}, 1
    for d in reversed(kept):                 # the output: a new contiguous tensor over the kept dims
        out_stride[d] = s
        s *= shape[d]
    dims = [(shape[d], strides[d], d in reduced, out_stride.get(d, 0)) for d in range(len(shape)) if shape[d] > 1]
    dims.sort(key=lambda x: (not x[2], x[3] if not x[2] else x[1]))
    merged: list[list] = []
    for size, st, red, ost in dims:
        if merged:
            p = merged[-1]
            if p[2] == red and p[1] * p[0] == st and p[3] * p[0] == ost:
                p[0] *= size
                continue
        merged.append([size, st, red, ost])
    return [(m[0], m[1], m[2]) for m in merged]


def global_reduce_bytes(shape, strides, dims, elem_size: int, *, acc_size: int = 4, sm_count: int,
                        max_threads_per_sm: int, aligned: bool = True) -> tuple[int, int]:
    """(staging buffer, semaphores) bytes one ``gpu_reduce_kernel`` call allocates; (0, 0) where the blocks do not
    reduce through global memory. ``dims``: the reduced dims (empty: all); ``elem_size``: the input's element
    size; ``acc_size``: the accumulator's (``arg_t``: float for fp32/fp16/bf16 sums and means)."""
    n = len(shape)
    if n == 0:
        return 0, 0         # a 0-dim tensor: one value, one thread
    reduced = {d % n for d in dims} if dims else set(range(n))
    it = _iterator_dims(shape, strides, reduced)
    numel = 1
    for x in shape:
        numel *= x
    if numel == 0 or not it:
        return 0, 0
    num_outputs = 1
    for size, _, red in it:
        if not red:
            num_outputs *= size
    inputs = numel // num_outputs
    nred = sum(1 for _, _, red in it if red)
    on_fastest = nred == len(it) or it[0][1] < it[nred][1]
    if on_fastest:
        dim0, dim1, fastest_stride = inputs, num_outputs, it[0][1]
    else:
        dim0, dim1, fastest_stride = num_outputs, inputs, it[nred][1]
    out_vec = 1
    if fastest_stride == 1:
        if on_fastest and dim0 > 128 and nred == 1:
            dim0 //= INPUT_VEC                       # vectorize along the input
        elif not on_fastest:
            out_vec = 4                              # get_output_vec_size: the largest of 4, 2, 1 dividing ...
            for v in [it[nred][0]] + [st for i, (_, st, _) in enumerate(it) if i != nred] + ([0] if aligned else [1]):
                while v % out_vec:
                    out_vec //= 2
            dim0 //= out_vec
    max_threads = MAX_NUM_THREADS // out_vec
    d0 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    d1 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    bw = min(d0, WARP)
    bh = min(d1, max_threads // bw)
    bw = min(d0, max_threads // bh)
    threads = bw * bh
    step_in = step_out = 1
    block_x_reduce = False
    if on_fastest:
        step_in *= bw
        block_x_reduce = True
    else:
        step_out *= bw
    values = _div_up(inputs, step_in)
    split_y = values >= bh * 16 or values >= MAX_VALUES_PER_THREAD
    if split_y:
        step_in *= bh
    else:
        step_out *= bh
    values = _div_up(inputs, step_in)
    grid_x = _div_up(num_outputs // out_vec, step_out)
    target = sm_count * (max_threads_per_sm // threads)
    if not (split_y and values >= MAX_VALUES_PER_THREAD and grid_x <= target):
        return 0, 0
    ctas = max(min(_div_up(target, grid_x), _div_up(values, MIN_VALUES_PER_THREAD)),
               _div_up(values, MAX_VALUES_PER_THREAD))
    if ctas <= 1:
        return 0, 0
    size = acc_size * num_outputs * ctas
    if not block_x_reduce:
        size *= bw * out_vec
    return size, 4 * grid_x


class ReduceScratch(NamedTuple):
    """The op of a reduction's scratch allocation in an event log: what sizes it (``part`` 0: the staging buffer, 1:
    the semaphores). Logged for every float reduction, 0 bytes where the blocks do not reduce through global memory,
    so a log's sequence does not change with the batch size or sequence length; :mod:`memlens.estimator.scaling`
    fits the shape and strides across traces and sizes the scratch again at another point (:meth:`at`)."""

    part: int
    shape: tuple
    strides: tuple
    dims: tuple
    elem_size: int
    sm_count: int
    max_threads_per_sm: int

    def __str__(self) -> str:
        return "cuda reduction staging" if self.part == 0 else "cuda reduction semaphores"

    @property
    def nbytes(self) -> int:
        return global_reduce_bytes(self.shape, self.strides, self.dims, self.elem_size, sm_count=self.sm_count,
                                   max_threads_per_sm=self.max_threads_per_sm)[self.part]

    @property
    def kind(self) -> tuple:
        """What the scratch is apart from the sizes (the same at every batch size and sequence length)."""
        return ("reduce_scratch", self.part, len(self.shape), self.dims, self.elem_size, self.sm_count,
                self.max_threads_per_sm)

    @property
    def numbers(self) -> tuple:
        """The sizes a batch size or sequence length can change: the shape, then the strides."""
        return self.shape + self.strides

    def at(self, numbers: tuple) -> "ReduceScratch":
        n = len(self.shape)
        return self._replace(shape=tuple(numbers[:n]), strides=tuple(numbers[n:]))
