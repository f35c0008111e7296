"""Later simulated steps written from the first one: the forward and backward of step n >= 2
allocate and free what step 1's did, in the same order; only the optimizer phase is run again.

Why two steps are simulated at all: from step 2 on the optimizer state exists during forward and
backward, and the allocator starts from the segments step 1 left (the reserved peak can move to
step 2). The events themselves repeat:

1. The forward and backward of a step are a function of the model's tensors (their shapes and
   dtypes: values do not exist on fake tensors), of ``.grad`` (None at the start of every step:
   ``zero_grad(set_to_none=True)``), of the batch (the same tensors every step) and of the CUDA
   emulation's one-time state (the cuBLAS workspaces, taken at the first GEMM of each thread).
2. So step n's forward and backward run the same ops on the same shapes as step 1's. Each op
   allocates the same storages, and each storage dies at the same point (reference counts are
   the same), except the storages created once and kept: those that outlive step 1.
3. The only storages of step 1's forward and backward that may outlive it are the emulated
   workspaces, which by construction are not taken again. Anything else that outlives step 1
   (a module caching a tensor, a lazily built parameter) could be replaced at step 2, so then
   step 2 is simulated in full.
4. The optimizer does differ between steps (it creates its state at step 1), so its phase is
   always run again, on stand-ins for the gradients and the returned loss: fake tensors of the
   same storage size, accounted under the keys of the copied events, so that ``zero_grad`` and
   the end of the step free them as they would free the real ones.

Checked at run time, or step n is simulated in full (``reason`` says which failed): step 1's
forward/backward frees no storage made before it; tags it puts on older storages would not be
emitted again; what outlives step 1 is workspace only; what is alive when the optimizer phase
starts is exactly the gradients and the returned loss; no DP-SGD (its hooks keep state).
``tests/estimator/test_periodic.py`` compares the written steps with fully simulated ones event
by event.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch

from ..core import progress as _progress
from ..core.enums import Category
from ..core.errors import SpecError
from ..core.events import ALLOC, FREE, PHASE, TAG, Free
from .periodic_dp import DPFirstStep
from .standins import Meta as _Meta
from .standins import standin_meta as _standin_meta


@dataclass
class Repeat:
    """Step 1's forward and backward as a template for later steps."""

    segment: list[tuple]                # step 1's events from its first forward mark to its optimizer mark
    fresh: list[Any]                    # keys allocated in it that later steps allocate again, in order
    grads: list[tuple[Any, Any, _Meta, str]]   # (parameter, key in step 1, meta, category at the optimizer)
    loss: tuple[Any, _Meta, str] | None  # the returned loss: (key in step 1, meta, category)
    WRITTEN: ClassVar[str] = "forward and backward"           # what of step n is written (Steps.later_steps)
    UNMADE: ClassVar[str] = "a stand-in for a gradient or the loss cannot be made"

    def run(self, n: int, tracker, step, on_phase: Callable[[str], None]) -> bool:
        """Write step ``n``'s forward and backward into the log, then run its optimizer phase.
        Returns False (nothing written) if a stand-in cannot be made."""
        remap = {k: tracker.new_key() for k in self.fresh}
        tracker.muted = True
        try:
            grads = [(p, g.make(), remap[k], cat) for p, k, g, cat in self.grads]
            loss = (self.loss[1].make(), remap[self.loss[0]], self.loss[2]) if self.loss else None
        finally:
            tracker.muted = False
        if any(t is None for _, t, _, _ in grads) or (loss is not None and loss[0] is None):
            return False
        out = tracker.log.events
        for ev in self.segment:
            if ev.kind == PHASE:
                out.append(ev.at_step(n))
                continue
            new = remap.get(ev.key)
            if new is None:
                continue            # a one-time allocation, or a tag that would not be emitted again
            out.append(ev.rekeyed(new))
        tracker.resume("backward", n)
        _install(tracker, grads)
        grads.clear()               # the parameters hold the gradients now, nothing else
        standin = None
        if loss is not None:
            standin = loss[0]
            tracker.adopt(standin, loss[1], loss[2])
            loss = None
        step.run_optimizer(on_phase)
        del standin                 # the loop drops the loss train_step returned here
        return True


def _install(tracker, grads) -> None:
    for p, t, key, cat in grads:
        tracker.adopt(t, key, cat)
        p.grad = t


class FirstStep:
    """Watches step 1 (call :meth:`at_phase` before each phase mark is logged) and tells whether
    later steps can be written from it (:meth:`plan`)."""

    def __init__(self, tracker, params: list):
        self.tracker = tracker
        self.params = params
        self.start: int | None = None
        self.stop: int | None = None
        self.grads: list[tuple[Any, Any, _Meta]] = []

    def at_phase(self, name: str) -> None:
        n = len(self.tracker.log.events)
        if name == "forward" and self.start is None:
            self.start = n
        elif name == "optimizer" and self.stop is None:
            self.stop = n
            self.grads = [(p, self.tracker.key_of(p.grad), _Meta.of(p.grad)) for p in self.params if p.grad is not None]

    def plan(self, loss_key: Any, loss_meta: _Meta | None) -> Repeat | str:
        """A :class:`Repeat`, or why step 2 must be simulated in full (see the module docstring)."""
        if self.start is None or self.stop is None:
            return "step 1 has no forward or no optimizer phase"
        events = self.tracker.log.events
        seg = events[self.start:self.stop]
        allocated: dict[Any, str] = {}       # key -> category at allocation, in order
        final: dict[Any, str] = {}
        live: set = set()
        older_tags: dict[Any, str] = {}
        for ev in seg:
            kind = ev.kind
            if kind == ALLOC:
                allocated[ev.key] = ev.category
                live.add(ev.key)
            elif kind == FREE:
                if ev.key not in allocated:
                    return "step 1 frees a storage made before it"
                live.discard(ev.key)
            elif kind == TAG:
                if ev.key in allocated:
                    final[ev.key] = ev.category
                elif older_tags.setdefault(ev.key, ev.category) != ev.category:
                    return "step 1 tags a storage made before it twice"
        for key, cat in older_tags.items():
            if self.tracker.category_of(key) != cat:
                return "step 1 retags a storage made before it"
        # what outlives step 1: everything freed later is not
        outlive = set(live) - {loss_key}      # the loss dies as soon as the step returns
        for ev in events[self.stop:]:
            if ev.kind == FREE:
                outlive.discard(ev.key)
        odd = [k for k in outlive if final.get(k, allocated[k]) != Category.WORKSPACE]
        if odd:
            return f"{len(odd)} storage(s) made in step 1's forward or backward outlive it"
        carried = live - outlive
        grad_keys = [k for _, k, _ in self.grads]
        expected = set(grad_keys) | ({loss_key} if loss_key is not None else set())
        if len(set(grad_keys)) != len(grad_keys) or None in expected or carried != expected:
            return "what is alive at the optimizer phase is not just the gradients and the loss"
        cat = lambda k: final.get(k, allocated[k])  # noqa: E731
        return Repeat(seg, [k for k in allocated if k not in outlive],
                      [(p, k, m, cat(k)) for p, k, m in self.grads],
                      (loss_key, loss_meta, cat(loss_key)) if loss_key is not None else None)


def loss_of(tracker, last) -> tuple[Any, _Meta | None]:
    """(key, meta) of the loss a step returned, or (None, None)."""
    if isinstance(last, torch.Tensor) and tracker.key_of(last) is not None:
        return tracker.key_of(last), _Meta.of(last)
    return None, None


# ---------------------------------------------------------------- the micro-batches of a step
class _PreviousLoss:
    """The key, in a template micro-batch, of the previous micro-batch's loss (its free)."""


# Micro-batches written into the log at most; the rest of a step's micro-batches are not written. Each written
# one starts from the same live storages (parameters, gradients added into in place, optimizer state, the previous
# micro-batch's loss: the template's checks) and allocates and frees the same sizes in the same order, so the
# allocated curve of every later one is the same as the last written one's, and the caching allocator, fed the
# same requests from a state it has already been in, places them the same (tests/estimator/test_periodic.py
# compares an elided step's peaks with the same step written in full). Writing them all costs time and memory
# with the count (--grad-accum 2048 on gpt2: 117 s, 3.5 GB) and changes no number memlens reports.
WRITTEN_MICRO_BATCHES = 8


def _elided(label: str, written: int) -> str:
    """``"2..k written from micro-batch 1"`` -> ``"2..9 written from micro-batch 1, 10..k as those (not written)"``."""
    span, _, rest = label.partition(" ")
    first, _, last = span.partition("..")
    stop = int(first) + written - 1
    return f"{first}..{stop} {rest}, {stop + 1}..{last} as those (not written)"


class SkipMicroBatches(Exception):
    """Raised at the start of a micro-batch when it and the rest of the step can be written from an
    earlier one (:class:`MicroBatches`); :meth:`finish` writes them and runs the step's optimizer phase."""

    def __init__(self, template: list[tuple], carried_in: Any, carried_out: Any, meta: _Meta, category: str, count: int,
                 label: str = ""):
        super().__init__(label)
        self.template, self.carried_in, self.carried_out = template, carried_in, carried_out
        self.meta, self.category, self.count, self.label = meta, category, count, label

    def finish(self, n: int, tracker, step, on_phase: Callable[[str], None]):
        """Write the last ``count`` micro-batches of step ``n`` (at most :data:`WRITTEN_MICRO_BATCHES`
        of them, see there), then its optimizer phase; returns the step's loss (a stand-in)."""
        out = tracker.log.events
        prev = self.carried_out                 # the loss of the micro-batch before them, freed in the first written
        written = min(self.count, WRITTEN_MICRO_BATCHES)
        if written < self.count:
            self.label = _elided(self.label, written)
        for _ in range(written):
            remap = {}
            for ev in self.template:
                kind = ev.kind
                if kind == PHASE:
                    out.append(ev.at_step(n))
                elif kind == ALLOC:
                    new = remap[ev.key] = tracker.new_key()
                    out.append(ev.rekeyed(new))
                elif kind == FREE:
                    out.append(ev.rekeyed(prev if ev.key == self.carried_in else remap[ev.key]))
                elif ev.key in remap:
                    out.append(ev.rekeyed(remap[ev.key]))
            prev = remap[self.carried_out]
        tracker.resume("backward", n)
        tracker.muted = True
        try:
            loss = self.meta.make()
        finally:
            tracker.muted = False
        if loss is None:          # checked before anything was written (see MicroBatches)
            raise AssertionError("stand-in")
        tracker.adopt(loss, prev, self.category)
        step.run_optimizer(on_phase)
        return loss


class MicroBatches:
    """Watches a step's micro-batches (call :meth:`at_phase` before each phase mark is logged) and
    writes the later ones from an earlier one where they provably allocate and free alike.

    Micro-batches 2..k from micro-batch 1 (k >= 2). Micro-batch 2 runs the same ops on the same
    batch as micro-batch 1; the one difference is at each parameter's gradient accumulator
    (torch/csrc/autograd/functions/accumulate_grad.h). In micro-batch 1 ``.grad`` is None, and the
    incoming gradient is stolen as ``.grad`` (no copy when nothing else holds it and its layout is
    the parameter's). From micro-batch 2 on it is added in place into ``.grad`` and freed when the
    accumulator returns. So micro-batch 2 is micro-batch 1 with, for each parameter, the
    incoming gradient's free written where micro-batch 1's accumulator returned, without the tag
    that made it a gradient, and with micro-batch 1's loss freed where micro-batch 2 replaces it.
    Checked on micro-batch 1's events (hooks before and after each accumulator): every accumulator
    ran once and only tagged the gradient it stole (no copy); micro-batch 1 freed and retagged no
    older storage, and what it leaves alive is the gradients, its loss and the one-time
    workspaces. Else micro-batch 2 is simulated.

    Micro-batches 3..k from micro-batch 2 (k >= 3, when micro-batch 2 was simulated): micro-batches
    2..k start from the same storages (the parameters, the gradients accumulated in place, the
    optimizer state, the previous micro-batch's loss) and run the same ops on the same batch. At
    the start of micro-batch 3 this is checked on micro-batch 2's events: it frees exactly one
    storage from before it (micro-batch 1's loss), tags none that would be tagged again, and
    leaves exactly one storage alive (its own loss) whose stand-in can be made.

    Either way :class:`SkipMicroBatches` is raised and the rest is written."""

    def __init__(self, tracker, micro_batches: int, params: list | None = None):
        self.tracker = tracker
        self.k = micro_batches
        self.params = [p for p in (params or []) if p.requires_grad]
        self.marks: list[int] = []
        self._pre: dict[int, list[int]] = {}       # id(parameter) -> positions where its accumulator started
        self._post: list[tuple[Any, int]] = []     # (parameter, position) as each accumulator returned
        self._hooks: list = []

    def at_phase(self, name: str) -> None:
        if self.k < 2:
            return
        if name == "backward" and len(self.marks) == 1 and self.params:
            self._watch_accumulators()
        if name != "forward":
            return
        self.marks.append(len(self.tracker.log.events))
        skip = None
        if len(self.marks) == 2:
            self._unhook()
            skip = self._from_first()
        elif len(self.marks) == 3:
            skip = self._plan()
        if skip is not None:
            self.tracker.disown(skip.carried_out)   # its free is in the next micro-batch, written by hand
            raise skip

    def close(self) -> None:
        self._unhook()

    def _watch_accumulators(self) -> None:
        events = self.tracker.log.events
        get_edge = getattr(torch.autograd.graph, "get_gradient_edge", None)
        if get_edge is None:       # pragma: no cover - torch >= 2.2 has it
            return
        for p in self.params:
            try:
                node = get_edge(p).node
            except RuntimeError:
                continue
            if node is None:
                continue
            self._hooks.append(node.register_prehook(
                lambda grads, i=id(p): self._pre.setdefault(i, []).append(len(events))))
            self._hooks.append(p.register_post_accumulate_grad_hook(lambda t: self._post.append((t, len(events)))))

    def _unhook(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _from_first(self) -> SkipMicroBatches | None:
        """Micro-batch 2 as micro-batch 1 would make it (see the class docstring), or None."""
        pre, post = self._pre, self._post
        self._pre, self._post = {}, []
        events = self.tracker.log.events
        m1, m2 = self.marks
        if not post:
            return None
        allocated: dict[Any, int] = {}
        live: set = set()
        category: dict[Any, str] = {}
        for i in range(m1, m2):
            ev = events[i]
            kind = ev.kind
            if kind == ALLOC:
                allocated[ev.key] = i
                live.add(ev.key)
                category[ev.key] = ev.category
            elif kind == FREE:
                if ev.key not in allocated:
                    return None              # frees a storage made before it
                live.discard(ev.key)
            elif kind == TAG:
                if ev.key not in allocated:
                    return None              # tags a storage made before it
                category[ev.key] = ev.category
        grads: dict[Any, tuple[int, int]] = {}   # gradient key -> where its accumulator started and returned
        seen = set()
        for p, at in post:
            if id(p) in seen or p.grad is None:
                return None
            seen.add(id(p))
            starts = pre.get(id(p), [])
            key = self.tracker.key_of(p.grad)
            if len(starts) != 1 or key is None or key not in allocated or allocated[key] >= starts[0]:
                return None                  # not run once, or the gradient is a copy it made
            if any(ev.kind != TAG or ev.key != key for ev in events[starts[0]:at]):
                return None                  # the accumulator did more than tag the gradient it stole
            grads[key] = (starts[0], at)
        if any(p.grad is not None and id(p) not in seen for p in self.params):
            return None
        workspace = {k for k in live if category[k] == Category.WORKSPACE}
        rest = live - set(grads) - workspace
        if len(rest) != 1 or any(k not in live for k in grads):
            return None
        loss = next(iter(rest))
        meta = _standin_meta(self.tracker, loss)
        if meta is None:
            return None
        rank = events[m1].rank
        frees: dict[int, list] = {}
        for key, (_, at) in grads.items():
            frees.setdefault(at, []).append(Free(FREE, key, rank))
        previous = _PreviousLoss()
        template: list[tuple] = []
        for i in range(m1, m2 + 1):
            for f in frees.get(i, ()):
                template.append(f)
            if i == m2:
                break
            ev = events[i]
            if ev.kind != PHASE and ev.key in workspace:
                continue
            if ev.kind == TAG and ev.key in grads and grads[ev.key][0] <= i < grads[ev.key][1]:
                continue                     # the accumulator's tag: micro-batch 2 adds into .grad instead
            template.append(ev)
        template.append(Free(FREE, previous, rank))
        return SkipMicroBatches(template, previous, loss, meta, self.tracker.category_of(loss, category[loss]), self.k - 1,
                                label=f"2..{self.k} written from micro-batch 1")

    def _plan(self) -> SkipMicroBatches | None:
        events = self.tracker.log.events
        m1, m2, m3 = self.marks
        first, second = events[m1:m2], events[m2:m3]
        alive1 = set()
        for ev in first:
            if ev.kind == ALLOC:
                alive1.add(ev.key)
            elif ev.kind == FREE:
                alive1.discard(ev.key)
        allocated, live, older_frees = {}, set(), []
        for ev in second:
            kind = ev.kind
            if kind == ALLOC:
                allocated[ev.key] = ev.category
                live.add(ev.key)
            elif kind == FREE:
                if ev.key in allocated:
                    live.discard(ev.key)
                else:
                    older_frees.append(ev.key)
            elif kind == TAG and ev.key not in allocated:
                return None         # a tag on an older storage: not shown to repeat
        if len(older_frees) != 1 or older_frees[0] not in alive1 or len(live) != 1:
            return None
        out = next(iter(live))
        meta = _standin_meta(self.tracker, out)
        if meta is None:
            return None
        cat = self.tracker.category_of(out, allocated[out])
        return SkipMicroBatches(second, older_frees[0], out, meta, cat, self.k - 2, label=f"3..{self.k} written from micro-batch 2")


# ---------------------------------------------------------------- the steps of a simulation
# Micro-batches simulated one by one at most (when none can be written: a multi-GPU wrapper's hooks, DP-SGD,
# --compile): each costs a whole forward and backward (FSDP2 on gpt2: about 4 s each on a 2-core CPU).
SIMULATED_MICRO_BATCHES = 32


class Steps:
    """Runs the optimizer steps of a simulation (the caller's loop: ``at_phase`` from its
    ``on_phase`` hook, before the mark is logged; ``run`` for each step), writing what it can
    prove the same from what was simulated: steps 2.. from step 1 (:class:`Repeat`), micro-batches
    3..k from micro-batch 2 (:class:`MicroBatches`). ``why_not`` (e.g. DP-SGD's stateful hooks)
    turns both off. ``later_steps`` and ``later_micro_batches`` say what happened."""

    def __init__(self, tracker, step, params: list, *, why_not: str = "", label: str = ""):
        self.tracker, self.step, self.label, self._progress = tracker, step, label, _progress
        self.params = params
        self.k = step.spec.grad_accum
        dp = getattr(step, "dp", None)
        self.first = FirstStep(tracker, params) if not why_not and dp is None else None
        self.dp_first = DPFirstStep(tracker, dp) if not why_not and dp is not None else None
        self.later: Any = why_not             # Repeat, DPRepeat, or why step n is simulated
        self.micro = "simulated" if self.k >= 2 else ""
        self._watch: MicroBatches | None = None
        self._n = 0
        self._forwards = 0
        if self.first is None and self.k > SIMULATED_MICRO_BATCHES:
            raise SpecError(f"--grad-accum {self.k}: here each micro-batch is simulated in full "
                            f"({why_not or 'DP-SGD keeps state between them'}), at most {SIMULATED_MICRO_BATCHES} are",
                            hint=f"estimate --grad-accum {SIMULATED_MICRO_BATCHES}: from the second micro-batch on, "
                                 "each starts from the same storages (the gradients are added into in place)")

    def at_phase(self, name: str, n: int) -> None:
        if name == "forward" and self.k >= 2:
            self._forwards += 1
            j = (self._forwards - 1) % self.k + 1
            self._progress.stage(f"{self.label}: step {n} micro-batch {j}/{self.k}")
        if self._watch is not None:
            self._watch.at_phase(name)        # may end the micro-batch loop (SkipMicroBatches)
        if n == 1 and self.first is not None:
            self.first.at_phase(name)

    def run(self, n: int, on_phase: Callable[[str], None]) -> None:
        """Step ``n``: written from step 1 if proven, else simulated (its micro-batches 3..k written if proven)."""
        if n > 1 and not isinstance(self.later, str):        # a Repeat, or DP-SGD's DPRepeat
            self._progress.stage(f"{self.label}: step {n} {self.later.WRITTEN} written from step 1")
            if self.later.run(n, self.tracker, self.step, on_phase):
                return
            self.later = self.later.UNMADE
        self._watch = MicroBatches(self.tracker, self.k, self.params) if self.first is not None else None
        try:
            last = self.step.run(on_phase)
        except SkipMicroBatches as skip:
            self._progress.stage(f"{self.label}: step {n} micro-batches {skip.label}")
            last = skip.finish(n, self.tracker, self.step, on_phase)
            self.micro = skip.label
            del skip
        finally:
            if self._watch is not None:
                self._watch.close()
            self._watch = None
        if n == 1 and self.first is not None:
            self.later = self.first.plan(*loss_of(self.tracker, last))
        if n == 1 and self.dp_first is not None:
            self.later = self.dp_first.plan()
        del last                              # as the loop drops the loss the step returned

    @property
    def later_steps(self) -> str:
        if isinstance(self.later, Repeat):
            return "written from step 1"
        return f"simulated ({self.later})" if isinstance(self.later, str) else f"{self.later.WRITTEN} written from step 1"
