"""The accounting both sides share: PyTorch's caching allocator, and one replay of an event log.

A simulated step (estimate) or a real one (profile) fills a :class:`~memlens.core.events.EventLog`.
Replaying it through :class:`CachingAllocatorModel` gives what ``torch.cuda.memory_allocated`` and
``memory_reserved`` would read at every moment (or, with :class:`RawSizes`, live storage bytes);
:func:`analyze` is that one replay: the peak and its breakdown by category, module and phase,
each phase's and step's peak, and the timeline.

Allocator facts modelled (c10/cuda/CUDACachingAllocator.cpp, default settings):
- every request is rounded up to a multiple of 512 B (kMinBlockSize);
- requests <= 1 MiB (kSmallSize) use the small pool of 2 MiB segments (kSmallBuffer);
- larger requests use the large pool: segments of 20 MiB (kLargeBuffer) for requests < 10 MiB
  (kMinLargeAlloc), else the request rounded up to 2 MiB (kRoundLarge);
- a cached free block is chosen best-fit (smallest size, then lowest address); the addresses are the driver's
  (cudaMalloc's), which on an H200 placed each new large segment below the earlier ones (56 of 59 segments of
  20 MiB+ in a ZeRO-1 GPT-2 medium trace, bench/results/zero1_probe.md): modelled so, a tie between equal free
  blocks goes to the newest segment - which decides where a [V, H] gradient lands when several such blocks
  are free (Llama-3.2-3B checkpointed on an H100 -2.97% -> -0.01% reserved; the ZeRO-1 owner rank on 2 x H200
  exact);
- a block is split only if the remainder is >= 512 B (small pool) or > 1 MiB (large pool), so a
  large request can be handed a block up to 1 MiB bigger than asked, and ``allocated`` counts it;
- freed blocks merge with free neighbours in the same segment; segments are never released
  (no ``empty_cache``), so ``reserved`` only grows;
- every block belongs to the CUDA stream it was allocated on, and a free block is handed out only
  to a request on that same stream (``BlockComparatorSize`` orders pools by stream first and
  ``get_free_block`` rejects a block of another stream): collectives that allocate on their own
  streams (FSDP's all-gather copy-in and reduce-scatter streams) keep their own cached blocks.
  Streams are the ``stream`` of each :class:`~memlens.core.events.Alloc` (0: the default stream),
  so a single-stream log replays exactly as before.
"""
from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from .enums import CATEGORIES
from .events import ALLOC, FREE, PHASE, TAG, EventLog  # noqa: F401 - EventLog re-exported
from .timeline import simulated_point

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


@dataclass(slots=True)
class _Block:
    addr: int
    size: int
    segment: int
    free: bool = True
    prev: "_Block | None" = None
    next: "_Block | None" = None


class CachingAllocatorModel:
    """A model of PyTorch's CUDA caching allocator (one device, default config; per-stream pools).

    >>> a = CachingAllocatorModel()
    >>> a.malloc("x", 1000)
    1024
    >>> a.allocated, a.reserved
    (1024, 2097152)
    >>> a.free("x")
    1024
    >>> a.allocated, a.reserved
    (0, 2097152)
    >>> a.malloc("y", 1000, stream=1)     # the cached block belongs to stream 0: a new segment
    1024
    >>> a.reserved, a.num_segments
    (4194304, 2)
    """

    def __init__(self) -> None:
        self.allocated = 0          # sum of block sizes handed out ("allocated_bytes")
        self.requested = 0          # sum of requested sizes ("requested_bytes")
        self.reserved = 0           # sum of segment sizes ("reserved_bytes")
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.num_segments = 0
        self._next_addr = 1 << 62
        # free blocks per (pool, stream), sorted by (size, addr)
        self._free: dict[tuple[bool, int], list[tuple[int, int]]] = {(True, 0): [], (False, 0): []}
        self._blocks_by_addr: dict[int, _Block] = {}
        self._live: dict[Any, tuple[_Block, int]] = {}
        self._segments: dict[int, tuple[int, tuple[bool, int]]] = {}  # segment id -> (size, (small pool, stream))

    # -- pool bookkeeping
    def _insert_free(self, b: _Block, pool: tuple[bool, int]) -> None:
        bisect.insort(self._free[pool], (b.size, b.addr))

    def _remove_free(self, b: _Block, pool: tuple[bool, int]) -> None:
        lst = self._free[pool]
        i = bisect.bisect_left(lst, (b.size, b.addr))
        del lst[i]

    def malloc(self, key: Any, nbytes: int, stream: int = 0) -> int:
        """Allocate ``nbytes`` for ``key`` on ``stream``; returns the block size charged to ``allocated``. Zero bytes
        take no block (the allocator returns a null pointer without touching its pools)."""
        if nbytes == 0:
            self._live[key] = (None, 0)
            return 0
        size = round_size(nbytes)
        small = size <= K_SMALL_SIZE
        pool = (small, stream)
        lst = self._free.get(pool)
        if lst is None:
            lst = self._free[pool] = []
        i = bisect.bisect_left(lst, (size, -1))
        if i < len(lst):
            bsize, addr = lst[i]
            del lst[i]
            block = self._blocks_by_addr[addr]
        else:
            seg = segment_size(size)
            self._next_addr -= seg + (1 << 30)  # below every earlier segment (gap: segments never merge)
            block = _Block(self._next_addr, seg, self.num_segments)
            self._segments[self.num_segments] = (seg, pool)
            self._blocks_by_addr[block.addr] = block
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
            self._insert_free(rest, pool)
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
        if block is None:
            return 0
        released = block.size
        self.allocated -= released
        self.requested -= nbytes
        pool = self._segments[block.segment][1]
        block.free = True
        for nb in (block.prev, block.next):
            if nb is not None and nb.free:
                self._remove_free(nb, pool)
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
        self._insert_free(block, pool)
        return released

    def is_live(self, key: Any) -> bool:
        return key in self._live

    @property
    def inactive_split_bytes(self) -> int:
        """Free bytes inside segments that also hold live blocks (fragmentation, as memory_stats names it)."""
        live_segments = {b.segment for b, _ in self._live.values() if b is not None}
        total = 0
        for lst in self._free.values():
            for size, addr in lst:
                if self._blocks_by_addr[addr].segment in live_segments:
                    total += size
        return total


# ------------------------------------------------------------------------- the one replay
class RawSizes:
    """A sizer without an allocator: each storage counts ``size_fn(nbytes)`` (raw bytes on the CPU;
    :func:`round_size` for a measured CUDA run whose blocks the allocator history gives).
    Reserved memory is not modelled: it reads as allocated."""

    def __init__(self, size_fn: Callable[[int], int] = lambda n: n):
        self.size_fn = size_fn
        self.allocated = self.requested = self.peak_reserved = self.num_segments = 0
        self._live: dict[Any, tuple[int, int]] = {}

    @property
    def reserved(self) -> int:
        return self.allocated

    inactive_split_bytes = 0

    def is_live(self, key: Any) -> bool:
        return key in self._live

    def malloc(self, key: Any, nbytes: int, stream: int = 0) -> int:
        size = self.size_fn(nbytes) if nbytes else 0
        self._live[key] = (size, nbytes)
        self.allocated += size
        self.requested += nbytes
        self.peak_reserved = max(self.peak_reserved, self.allocated)
        return size

    def free(self, key: Any) -> int:
        size, nbytes = self._live.pop(key)
        self.allocated -= size
        self.requested -= nbytes
        return size


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
    by_module: list[dict[str, Any]]          # live at the peak, + each module's forward/backward peak
    by_phase: dict[str, dict[str, Any]]      # peak allocated of each phase
    by_phase_allocated: dict[str, int]       # live at the peak, by the phase that allocated it
    timeline: list[dict[str, Any]]
    steps: list[dict[str, Any]]
    end_allocated_bytes: int
    end_reserved_bytes: int
    inactive_split_bytes_at_end: int
    num_segments: int


def _apply(sizer, ev) -> int | None:
    """Apply one event to the sizer; returns the bytes allocated (+) or freed (-), None for others."""
    kind = ev.kind
    if kind == ALLOC:
        if not sizer.is_live(ev.key):
            return sizer.malloc(ev.key, ev.nbytes, ev.stream) if ev.stream else sizer.malloc(ev.key, ev.nbytes)
    elif kind == FREE:
        if sizer.is_live(ev.key):
            return -sizer.free(ev.key)
    return None


def analyze(log: EventLog, max_points: int = 600, module_depth: int | None = None, sizer=None,
            stop_at_done: bool = True) -> Analysis:
    """Replay the log: the peak, its breakdown by category, module and allocating phase, each
    phase's and step's peak, each module's own forward/backward peak, and a timeline.

    ``sizer`` says what a storage costs: the caching-allocator model by default (what
    ``max_memory_allocated`` and ``max_memory_reserved`` read on CUDA), or a :class:`RawSizes`.
    A ``done`` phase mark ends the replay when ``stop_at_done`` (what follows is teardown).
    """
    a = sizer if sizer is not None else CachingAllocatorModel()
    r = _replay(log, a, stop_at_done)
    by_cat, live_rows, by_phase_alloc = _breakdown(log, r.effects[:r.effects_at_peak], module_depth)
    rows = _module_rows(log, live_rows, r.module_peak, module_depth)
    return Analysis(
        peak_allocated_bytes=max(r.peak_allocated, 0),
        peak_reserved_bytes=a.peak_reserved,
        peak_requested_bytes=r.peak_requested,
        peak_event=r.peak_event,
        peak_phase=r.peak_phase,
        peak_step=r.peak_step,
        by_category=by_cat,
        by_module=rows,
        by_phase={k: v for k, v in r.phase_stats.items() if k != "end"},
        by_phase_allocated=by_phase_alloc,
        timeline=downsample(r.points, max_points),
        steps=[r.step_stats[k] for k in sorted(r.step_stats) if k > 0],
        end_allocated_bytes=a.allocated,
        end_reserved_bytes=a.reserved,
        inactive_split_bytes_at_end=a.inactive_split_bytes,
        num_segments=a.num_segments,
    )


@dataclass
class _Replayed:
    """What one pass over a log through a sizer found (see :func:`_replay`)."""

    peak_event: int                                   # index of the event at the peak allocated (-1: none)
    peak_allocated: int
    peak_phase: str
    peak_step: int
    peak_requested: int
    points: list[tuple[int, str, int, int, int]]      # (event index, phase, step, allocated, reserved)
    phase_stats: dict[str, dict[str, Any]]
    step_stats: dict[int, dict[str, Any]]
    module_peak: dict[tuple[int, str], int]           # (module, phase) -> most of its allocations live at once
    effects: list[tuple[int, int]]                    # (event index, bytes allocated or freed) of events that took effect
    effects_at_peak: int                              # how many of ``effects`` happened up to the peak


def _replay(log: EventLog, a, stop_at_done: bool) -> _Replayed:
    """Apply every event to the sizer ``a`` once, noting the peaks as they happen."""
    phase, step = "setup", 0
    peak_i, peak_alloc, peak_phase, peak_step, at_peak = -1, -1, "setup", 0, 0
    raw: list[tuple[int, str, int, int, int]] = []
    phase_stats: dict[str, dict[str, Any]] = {}
    step_stats: dict[int, dict[str, Any]] = {}
    mod_live: dict[tuple[int, str], int] = defaultdict(int)
    mod_peak: dict[tuple[int, str], int] = defaultdict(int)
    owner: dict[Any, tuple[int, str]] = {}
    peak_requested = 0
    seen = False
    effects: list[tuple[int, int]] = []
    is_live, malloc, free = a.is_live, a.malloc, a.free
    ps = st = None          # this phase's and step's stats, once something takes effect in them
    for i, ev in enumerate(log.events):
        kind = ev.kind
        if kind == PHASE:
            if stop_at_done and ev.name == "done":
                break
            phase, step = ev.name, ev.step
            ps = st = None
            if phase == "end":
                st = step_stats.setdefault(step, {"step": step, "peak_allocated_bytes": 0})
                st["end_allocated_bytes"] = a.allocated
                st["end_reserved_bytes"] = a.reserved
            continue
        if kind == TAG:
            continue
        seen = True
        key = ev.key
        if kind == ALLOC:       # _apply, inline: the loop runs once per event of logs of millions
            if is_live(key):
                continue
            delta = malloc(key, ev.nbytes, ev.stream) if ev.stream else malloc(key, ev.nbytes)
            k = owner[key] = (ev.module, ev.phase)
        elif kind == FREE:
            if not is_live(key):
                continue
            delta = -free(key)
            k = owner.pop(key, None)
        else:
            continue
        effects.append((i, delta))
        if k is not None:
            v = mod_live[k] + delta
            mod_live[k] = v
            if v > mod_peak[k]:
                mod_peak[k] = v
        if a.requested > peak_requested:
            peak_requested = a.requested
        if a.allocated > peak_alloc:
            peak_alloc, peak_i, peak_phase, peak_step, at_peak = a.allocated, i, phase, step, len(effects)
        if ps is None:
            ps = phase_stats.setdefault(phase, {"peak_allocated_bytes": 0, "peak_step": step})
            st = step_stats.setdefault(step, {"step": step, "peak_allocated_bytes": 0})
        if a.allocated > ps["peak_allocated_bytes"]:
            ps["peak_allocated_bytes"], ps["peak_step"] = a.allocated, step
        if a.allocated > st["peak_allocated_bytes"]:
            st["peak_allocated_bytes"], st["peak_phase"] = a.allocated, phase
        raw.append((i, phase, step, a.allocated, a.reserved))
    if not seen:
        raise ValueError("empty event log")
    return _Replayed(peak_i, peak_alloc, peak_phase, peak_step, peak_requested, raw, phase_stats, step_stats,
                     mod_peak, effects, at_peak)


def _module_rows(log: EventLog, live_rows: list[dict[str, Any]], mod_peak: dict[tuple[int, str], int],
                 module_depth: int | None) -> list[dict[str, Any]]:
    """Rows per module: what it held at the peak, and the most of its own allocations live at once
    during forward and during backward (LoRA adapters flagged)."""
    names = log.modules
    fwd: dict[str, int] = defaultdict(int)
    bwd: dict[str, int] = defaultdict(int)
    for (m, ph), v in mod_peak.items():
        name = _mod_name(names, m, module_depth)
        if ph == "forward":
            fwd[name] = max(fwd[name], v)
        elif ph == "backward":
            bwd[name] = max(bwd[name], v)
    by_name = {r["module"]: r for r in live_rows}
    rows = []
    for name in set(by_name) | set(fwd) | set(bwd):
        r = by_name.get(name, {"module": name, "bytes": 0, "by_category": {}})
        if not (r["bytes"] or fwd.get(name) or bwd.get(name)):
            continue
        rows.append({**r, "forward_peak_bytes": fwd.get(name, 0), "backward_peak_bytes": bwd.get(name, 0),
                     "lora": ".lora_" in f".{name}"})
    rows.sort(key=lambda r: (-r["bytes"], -r["forward_peak_bytes"]))
    return rows


def _mod_name(names: list[str], m: int, module_depth: int | None) -> str:
    name = names[m] if 0 <= m < len(names) else "(none)"
    if module_depth is not None:
        name = ".".join(name.split(".")[:module_depth])
    return name


def breakdown_at(log: EventLog, index: int, module_depth: int | None = None, size_fn=None, sizer=None):
    """Live bytes right after event ``index``: (by category, by module rows, by allocating phase).

    Bytes are the allocator model's block sizes, so the categories sum to its peak exactly; a
    measured run passes ``size_fn`` (e.g. :func:`round_size`) to count each storage its own way.
    A tag says what a storage *is* (a gradient, a saved activation, optimizer state), which is
    often known only a little after it appears, so each storage gets its last tag.
    """
    if sizer is None:
        sizer = RawSizes(size_fn) if size_fn is not None else CachingAllocatorModel()
    effects = []
    for i, ev in enumerate(log.events):
        if i > index:
            break
        delta = _apply(sizer, ev)
        if delta is not None:
            effects.append((i, delta))
    return _breakdown(log, effects, module_depth)


def _breakdown(log: EventLog, effects: Iterable[tuple[int, int]], module_depth: int | None):
    """:func:`breakdown_at` from the events that took effect up to there, (event index, bytes
    allocated (+) or freed (-)), as a replay found them."""
    final = {ev.key: ev.category for ev in log.events if ev.kind == TAG}
    events = log.events
    live: dict[Any, list] = {}
    for i, delta in effects:
        ev = events[i]
        if ev.kind == ALLOC:
            live[ev.key] = [delta, final.get(ev.key, ev.category), ev.module, ev.phase]
        else:
            live.pop(ev.key, None)
    by_cat: dict[str, int] = {c: 0 for c in CATEGORIES}
    by_mod: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    by_phase: dict[str, int] = defaultdict(int)
    for size, cat, mod, phase in live.values():
        by_cat[cat] = by_cat.get(cat, 0) + size
        by_phase[phase] += size
        by_mod[_mod_name(log.modules, mod, module_depth)][cat] += size
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
    best = raw if bucket == 1 else [max(raw[s:s + bucket], key=lambda r: r[3]) for s in range(0, n, bucket)]
    return [simulated_point(*r) for r in best]


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


def replay(log: EventLog, size_fn: Callable[[int], int] | None = None, max_points: int = 600) -> Analysis:
    """:func:`analyze` of a measured log: each storage counts ``size_fn(nbytes)`` (raw bytes by
    default, :func:`round_size` for CUDA blocks), and the whole log is replayed.

    >>> log = EventLog(); log.alloc(1, 100, "parameters", log.module_id("fc"), "start")
    >>> replay(log).peak_allocated_bytes, replay(log, round_size).peak_allocated_bytes
    (100, 512)
    """
    return analyze(log, max_points, sizer=RawSizes(size_fn or (lambda n: n)), stop_at_done=False)
