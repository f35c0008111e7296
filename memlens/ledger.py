"""The accounting both sides share: an event log of storages, and PyTorch's caching allocator.

A simulated step (estimate) or a real one (profile) appends events to an :class:`EventLog`:
``alloc`` (a storage appears, with a category, module and phase), ``free``, ``tag`` (a storage
turns out to be a gradient / optimizer state / saved activation) and ``phase`` marks. Replaying
the log through :class:`CachingAllocatorModel` gives what ``torch.cuda.memory_allocated`` and
``memory_reserved`` would read at every moment; :func:`analyze` then finds the peak and breaks it
down by category, module and phase.

Allocator facts modelled (c10/cuda/CUDACachingAllocator.cpp, default settings):
- every request is rounded up to a multiple of 512 B (kMinBlockSize);
- requests <= 1 MiB (kSmallSize) use the small pool of 2 MiB segments (kSmallBuffer);
- larger requests use the large pool: segments of 20 MiB (kLargeBuffer) for requests < 10 MiB
  (kMinLargeAlloc), else the request rounded up to 2 MiB (kRoundLarge);
- a cached free block is chosen best-fit (smallest size, then lowest address);
- a block is split only if the remainder is >= 512 B (small pool) or > 1 MiB (large pool), so a
  large request can be handed a block up to 1 MiB bigger than asked, and ``allocated`` counts it;
- freed blocks merge with free neighbours in the same segment; segments are never released
  (no ``empty_cache``), so ``reserved`` only grows.
"""
from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable

from .report.result import CATEGORIES

KB_MIN_BLOCK = 512
K_SMALL_SIZE = 1 << 20          # 1 MiB
K_SMALL_BUFFER = 2 << 20        # 2 MiB
K_LARGE_BUFFER = 20 << 20       # 20 MiB
K_MIN_LARGE_ALLOC = 10 << 20    # 10 MiB
K_ROUND_LARGE = 2 << 20         # 2 MiB


def round_size(size: int) -> int:
    """Bytes the allocator asks its pools for (multiple of 512, at least 512).

    >>> round_size(1), round_size(512), round_size(513)
    (512, 512, 1024)
    """
    if size < KB_MIN_BLOCK:
        return KB_MIN_BLOCK
    return KB_MIN_BLOCK * ((size + KB_MIN_BLOCK - 1) // KB_MIN_BLOCK)


def segment_size(size: int) -> int:
    """Bytes cudaMalloc'ed for a new segment serving a (rounded) request.

    >>> segment_size(512) == 2 << 20, segment_size(4 << 20) == 20 << 20, segment_size(11 << 20) == 12 << 20
    (True, True, True)
    """
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * ((size + K_ROUND_LARGE - 1) // K_ROUND_LARGE)


@dataclass
class _Block:
    addr: int
    size: int
    segment: int
    free: bool = True
    prev: "_Block | None" = None
    next: "_Block | None" = None


class CachingAllocatorModel:
    """A model of PyTorch's CUDA caching allocator (one device, one stream, default config).

    >>> a = CachingAllocatorModel()
    >>> a.malloc("x", 1000)
    1024
    >>> a.allocated, a.reserved
    (1024, 2097152)
    >>> a.free("x")
    1024
    >>> a.allocated, a.reserved
    (0, 2097152)
    """

    def __init__(self) -> None:
        self.allocated = 0          # sum of block sizes handed out ("allocated_bytes")
        self.requested = 0          # sum of requested sizes ("requested_bytes")
        self.reserved = 0           # sum of segment sizes ("reserved_bytes")
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.num_segments = 0
        self._next_addr = 0
        # free blocks per pool, sorted by (size, addr)
        self._free: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
        self._blocks_by_addr: dict[int, _Block] = {}
        self._live: dict[Any, tuple[_Block, int]] = {}
        self._segments: dict[int, tuple[int, bool]] = {}  # segment id -> (size, small pool)

    # -- pool bookkeeping
    def _insert_free(self, b: _Block, small: bool) -> None:
        bisect.insort(self._free[small], (b.size, b.addr))

    def _remove_free(self, b: _Block, small: bool) -> None:
        lst = self._free[small]
        i = bisect.bisect_left(lst, (b.size, b.addr))
        del lst[i]

    def malloc(self, key: Any, nbytes: int) -> int:
        """Allocate ``nbytes`` for ``key``; returns the block size charged to ``allocated``."""
        size = round_size(nbytes)
        small = size <= K_SMALL_SIZE
        lst = self._free[small]
        i = bisect.bisect_left(lst, (size, -1))
        if i < len(lst):
            bsize, addr = lst[i]
            del lst[i]
            block = self._blocks_by_addr[addr]
        else:
            seg = segment_size(size)
            block = _Block(self._next_addr, seg, self.num_segments)
            self._segments[self.num_segments] = (seg, small)
            self._blocks_by_addr[block.addr] = block
            self._next_addr += seg + (1 << 30)  # gap: segments never merge
            self.num_segments += 1
            self.reserved += seg
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        remaining = block.size - size
        if (small and remaining >= KB_MIN_BLOCK) or (not small and remaining > K_SMALL_SIZE):
            rest = _Block(block.addr + size, remaining, block.segment, True, block, block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            self._blocks_by_addr[rest.addr] = rest
            self._insert_free(rest, small)
        block.free = False
        self._live[key] = (block, nbytes)
        self.allocated += block.size
        self.requested += nbytes
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return block.size

    def free(self, key: Any) -> int:
        """Free the block of ``key``; returns the block size released from ``allocated``."""
        block, nbytes = self._live.pop(key)
        released = block.size
        self.allocated -= released
        self.requested -= nbytes
        small = self._segments[block.segment][1]
        block.free = True
        for nb in (block.prev, block.next):
            if nb is not None and nb.free:
                self._remove_free(nb, small)
                if nb is block.prev:
                    nb.size += block.size
                    nb.next = block.next
                    if block.next is not None:
                        block.next.prev = nb
                    del self._blocks_by_addr[block.addr]
                    block = nb
                else:
                    block.size += nb.size
                    block.next = nb.next
                    if nb.next is not None:
                        nb.next.prev = block
                    del self._blocks_by_addr[nb.addr]
        self._insert_free(block, small)
        return released

    def is_live(self, key: Any) -> bool:
        return key in self._live

    @property
    def inactive_split_bytes(self) -> int:
        """Free bytes inside segments that also hold live blocks (fragmentation, as memory_stats names it)."""
        live_segments = {b.segment for b, _ in self._live.values()}
        total = 0
        for lst in self._free.values():
            for size, addr in lst:
                if self._blocks_by_addr[addr].segment in live_segments:
                    total += size
        return total


# ------------------------------------------------------------------------- event log
ALLOC, FREE, TAG, PHASE = 0, 1, 2, 3


@dataclass
class EventLog:
    """Storages appearing and disappearing, in program order."""

    events: list[tuple] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)   # module names, indexed by events
    _module_ids: dict[str, int] = field(default_factory=dict)

    def module_id(self, name: str) -> int:
        i = self._module_ids.get(name)
        if i is None:
            i = self._module_ids[name] = len(self.modules)
            self.modules.append(name)
        return i

    def alloc(self, key: Any, nbytes: int, category: str, module: int, phase: str, op: str = "") -> None:
        self.events.append((ALLOC, key, nbytes, category, module, phase, op))

    def free(self, key: Any) -> None:
        self.events.append((FREE, key))

    def tag(self, key: Any, category: str) -> None:
        self.events.append((TAG, key, category))

    def phase(self, name: str, step: int) -> None:
        self.events.append((PHASE, name, step))


@dataclass
class Analysis:
    """What a replay of an event log says (bytes are 'allocated' unless named otherwise)."""

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    peak_requested_bytes: int
    peak_event: int
    peak_phase: str
    peak_step: int
    by_category: dict[str, int]
    by_module: list[dict[str, Any]]
    by_phase: dict[str, dict[str, Any]]
    timeline: list[dict[str, Any]]
    steps: list[dict[str, Any]]
    end_allocated_bytes: int
    end_reserved_bytes: int
    inactive_split_bytes_at_end: int
    num_segments: int


def _replay(log: EventLog, stop: int | None = None):
    """Yield (index, event, allocator) after applying each event."""
    alloc = CachingAllocatorModel()
    for i, ev in enumerate(log.events):
        if stop is not None and i > stop:
            return
        kind = ev[0]
        if kind == ALLOC:
            if not alloc.is_live(ev[1]):
                alloc.malloc(ev[1], ev[2])
        elif kind == FREE:
            if alloc.is_live(ev[1]):
                alloc.free(ev[1])
        yield i, ev, alloc


def analyze(log: EventLog, max_points: int = 600, module_depth: int | None = None) -> Analysis:
    """Replay the log through the allocator model: peak, breakdowns, timeline, per-step figures."""
    phase, step = "setup", 0
    peak_i, peak_alloc, peak_phase, peak_step = -1, -1, "setup", 0
    raw: list[tuple[int, str, int, int, int]] = []   # (event index, phase, step, allocated, reserved)
    phase_stats: dict[str, dict[str, Any]] = {}
    step_stats: dict[int, dict[str, Any]] = {}
    peak_requested = 0
    a = None
    for i, ev, a in _replay(log):
        if ev[0] == PHASE:
            if ev[1] == "done":
                break  # what follows is teardown, not training
            phase, step = ev[1], ev[2]
            if phase == "end":
                st = step_stats.setdefault(step, {"step": step, "peak_allocated_bytes": 0})
                st["end_allocated_bytes"] = a.allocated
                st["end_reserved_bytes"] = a.reserved
            continue
        if ev[0] == TAG:
            continue
        if a.requested > peak_requested:
            peak_requested = a.requested
        if a.allocated > peak_alloc:
            peak_alloc, peak_i, peak_phase, peak_step = a.allocated, i, phase, step
        ps = phase_stats.setdefault(phase, {"peak_allocated_bytes": 0, "peak_step": step})
        if a.allocated > ps["peak_allocated_bytes"]:
            ps["peak_allocated_bytes"], ps["peak_step"] = a.allocated, step
        st = step_stats.setdefault(step, {"step": step, "peak_allocated_bytes": 0})
        if a.allocated > st["peak_allocated_bytes"]:
            st["peak_allocated_bytes"], st["peak_phase"] = a.allocated, phase
        raw.append((i, phase, step, a.allocated, a.reserved))
    if a is None:
        raise ValueError("empty event log")
    end_alloc, end_res, peak_res = a.allocated, a.reserved, a.peak_reserved
    inactive = a.inactive_split_bytes
    nseg = a.num_segments

    by_cat, by_mod, _ = breakdown_at(log, peak_i, module_depth)
    return Analysis(
        peak_allocated_bytes=max(peak_alloc, 0),
        peak_reserved_bytes=peak_res,
        peak_requested_bytes=peak_requested,
        peak_event=peak_i,
        peak_phase=peak_phase,
        peak_step=peak_step,
        by_category=by_cat,
        by_module=by_mod,
        by_phase={k: v for k, v in phase_stats.items() if k != "end"},
        timeline=downsample(raw, max_points),
        steps=[step_stats[k] for k in sorted(step_stats) if k > 0],
        end_allocated_bytes=end_alloc,
        end_reserved_bytes=end_res,
        inactive_split_bytes_at_end=inactive,
        num_segments=nseg,
    )


def breakdown_at(log: EventLog, index: int, module_depth: int | None = None, size_fn=None):
    """Live bytes right after event ``index``: (by category, by module rows, by allocating phase).

    Bytes are the allocator model's block sizes, so the categories sum to its peak exactly; a
    measured run passes ``size_fn`` (e.g. :func:`round_size`) to count each storage its own way.
    A tag says what a storage *is* (a gradient, a saved activation, optimizer state), which is
    often known only a little after it appears, so each storage gets its last tag.
    """
    final = {ev[1]: ev[2] for ev in log.events if ev[0] == TAG}
    live: dict[Any, list] = {}
    alloc = CachingAllocatorModel() if size_fn is None else None
    for i, ev in enumerate(log.events):
        if i > index:
            break
        kind = ev[0]
        if kind == ALLOC and ev[1] not in live:
            size = alloc.malloc(ev[1], ev[2]) if alloc is not None else size_fn(ev[2])
            live[ev[1]] = [size, final.get(ev[1], ev[3]), ev[4], ev[5]]
        elif kind == FREE and ev[1] in live:
            if alloc is not None:
                alloc.free(ev[1])
            del live[ev[1]]
    by_cat: dict[str, int] = {c: 0 for c in CATEGORIES}
    by_mod: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    by_phase: dict[str, int] = defaultdict(int)
    for size, cat, mod, phase in live.values():
        by_cat[cat] = by_cat.get(cat, 0) + size
        by_phase[phase] += size
        name = log.modules[mod] if mod >= 0 else "(none)"
        if module_depth is not None:
            name = ".".join(name.split(".")[:module_depth])
        by_mod[name][cat] += size
    rows = [{"module": m, "bytes": sum(c.values()), "by_category": dict(c)} for m, c in by_mod.items()]
    rows.sort(key=lambda r: -r["bytes"])
    return by_cat, rows, dict(by_phase)


def downsample(raw: list[tuple], max_points: int) -> list[dict[str, Any]]:
    """Keep at most ~max_points of (event, phase, step, allocated[, reserved]) points, always
    keeping each bucket's maximum."""
    if not raw:
        return []
    n = len(raw)
    bucket = max(1, n // max_points)
    out = []
    for s in range(0, n, bucket):
        best = max(raw[s:s + bucket], key=lambda r: r[3])
        point = {"event": best[0], "phase": best[1], "step": best[2], "allocated_bytes": best[3]}
        if len(best) > 4:
            point["reserved_bytes"] = best[4]
        out.append(point)
    return out


def module_group(name: str) -> str:
    """The block-level group of a module: `model.layers.3.mlp.up_proj` -> `model.layers.3.mlp`;
    LoRA adapters apart (`... .self_attn (LoRA)`); names without a numbered block stay whole.

    >>> module_group("model.layers.3.mlp.up_proj"), module_group("h.0.attn.c_attn.lora_A.default")
    ('model.layers.3.mlp', 'h.0.attn (LoRA)')
    """
    parts = name.split(".")
    lora = any(p.startswith("lora_") for p in parts)
    if lora:
        parts = parts[: next(i for i, p in enumerate(parts) if p.startswith("lora_"))]
    for i, p in enumerate(parts):
        if p.isdigit():
            parts = parts[: i + 2]
            break
    return ".".join(parts) + (" (LoRA)" if lora else "")


def group_modules(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """by_module rows summed per :func:`module_group`, largest first."""
    acc: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r in rows:
        g = module_group(r["module"])
        for c, v in r["by_category"].items():
            acc[g][c] += v
    out = [{"module": g, "bytes": sum(c.values()), "by_category": dict(c)} for g, c in acc.items()]
    out.sort(key=lambda r: -r["bytes"])
    return out


def sum_categories(by_category: dict[str, int], names: Iterable[str]) -> int:
    return sum(by_category.get(n, 0) for n in names)
