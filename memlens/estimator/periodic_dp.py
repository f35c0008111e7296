"""DP-SGD's later steps written from the first: the physical batches before the last one of step
n >= 2 allocate and free what step 1's did, in the same order; the last physical batch (noise, the
wrapped optimizer's update) is run again.

Why. A DP-SGD step (:class:`memlens.step.kinds.opacus.DPStep`) runs the physical batches of one
logical batch: each forward, backward and "clip" (Opacus' ``clip_and_accumulate`` into
``p.summed_grad``, the optimizer step skipped, ``zero_grad`` dropping ``p.grad`` and the per-sample
gradients). Only the last physical batch adds noise and steps the wrapped optimizer. At the end of
a step every parameter's ``grad``, ``grad_sample`` and ``summed_grad`` is None again, so step n's
physical batches 1..k-1 start from the state step 1's did (the same parameters and inputs, on the
same sizes; Opacus' hooks keep nothing from one step to the next but the held outputs below), and
none of them reads the optimizer's state: they run the same ops and allocate and free alike. Three
differences, written by hand:

- the loop that holds a physical batch's outputs (``logits = model(x).logits``, until the next
  forward returns) enters step n holding step n-1's last outputs: step n's first forward frees them
  where step 1's first forward replaced nothing (its position is marked by :class:`DPStep` itself),
  in the order physical batch 2 freed batch 1's;
- what Opacus keeps on a parameter or its wrappers across steps (ghost clipping's per-sample norms,
  until the next backward replaces them) is freed in step n's first backward where batch 2 freed
  batch 1's (batch 2's forward and backward must be batch 1's plus those frees);
- the CUDA emulation's one-time workspaces, taken in step 1, are not taken again.

Then the state step 1's last physical batch started from is installed with stand-ins (fake tensors
of the same storage size, logged under the copied events' keys): each parameter's ``summed_grad``
(its shape: it is added into) and kept norms, the held outputs, the previous physical batch's loss.
The last physical batch runs for real.

Checked on step 1's events (else step n is simulated in full; ``reason`` says which failed):
physical batches 1..k-1 free and tag no storage made before them; at the last physical batch's start
every parameter's ``grad`` and ``grad_sample`` is None, and what they left alive is exactly the
summed gradients, the kept norms, the held outputs, the loss and one-time workspaces. Not for a
multi-GPU wrapper (its hooks keep state). ``tests/estimator/test_periodic_dp.py`` compares written steps with fully
simulated ones event by event.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..core.enums import Category
from ..core.events import ALLOC, FREE, PHASE, TAG, EventLog, Free, canonical
from .standins import Meta as _Meta
from .standins import standin_meta as _standin_meta


def _storages(obj) -> list[torch.Tensor]:
    """The tensors ``obj`` holds, one per storage, in order: through tuples, lists, dicts and objects'
    attributes (a transformers ModelOutput, the key/value cache inside it). No closure, no cycle: the
    tensors found must die when the caller drops them (a free is an event)."""
    out, seen, visited = [], set(), set()
    todo = [(obj, 0)]
    while todo:
        x, depth = todo.pop()
        if isinstance(x, torch.Tensor):
            if id(x.untyped_storage()) not in seen:
                seen.add(id(x.untyped_storage()))
                out.append(x)
            continue
        if depth > 6 or id(x) in visited or isinstance(x, (str, bytes, int, float, bool, type(None), torch.nn.Module)):
            continue
        visited.add(id(x))
        items = list(x.values()) if isinstance(x, dict) else list(x) if isinstance(x, (list, tuple, set)) else \
            list(getattr(x, "__dict__", {}).values())
        todo.extend((v, depth + 1) for v in reversed(items))
    return out


# a parameter's attributes that Opacus keeps from one physical batch to the next (summed_grad: the clipped
# sum; ghost clipping's per-sample norms until the next backward replaces them)
_CARRIED = ("summed_grad", "_norm_sample", "_current_grad_sample")


class DPFirstStep:
    """Watches step 1 of a DP-SGD step on fake tensors (through ``DPStep.watch``) and tells whether its
    physical batches before the last can write later steps' (:meth:`plan`)."""

    def __init__(self, tracker, dp):
        self.tracker, self.dp = tracker, dp
        self.starts: dict[int, int] = {}    # physical batch -> event index where it starts (before it is gathered)
        self.held_at: int | None = None     # event index where physical batch 1 replaces the held outputs
        self.replaced: tuple[int, list] | None = None   # where batch 2 replaces batch 1's held outputs, and their keys
        self.carried: list | str = "the last physical batch never started"
        self.context: tuple = ()            # the tracker's phase, module and default category at the last batch's start
        self.holders: dict = {}             # at batch 2's start: key -> (object, attribute) of what Opacus keeps on them
        self.loss2: set = set()             # at batch 2's start: the keys of batch 1's loss
        dp.watch = self.at

    def at(self, what: str, i: int) -> None:
        if self.dp.runs != 1:
            return
        n = len(self.tracker.log.events)
        if what == "held" and i == 1:
            self.held_at = n
        elif what == "held" and i == 2:
            loss = self.dp.last_loss
            self.replaced = (n, [self.tracker.key_of(x) for x in _storages(list(self.dp.held))],
                             {self.tracker.key_of(x) for x in (_storages(loss) if loss is not None else [])})
        elif what == "batch":
            self.starts[i] = n
            if i == 2:
                self.holders = {self.tracker.key_of(getattr(obj, name)): (obj, name) for obj, name in self._attributes()}
                loss = self.dp.last_loss
                self.loss2 = {self.tracker.key_of(x) for x in (_storages(loss) if loss is not None else [])}
            if i == self.dp.n_physical:
                t = self.tracker
                self.context = (t.phase, t.module, t.category_default)
                self.carried = self._carried()

    def _carried(self) -> list | str:
        """[(what, holder, key, meta, category)]: the storages alive at the last physical batch's start, or why not."""
        t = self.tracker
        for p in self.dp._params():
            if p.grad is not None or getattr(p, "grad_sample", None) is not None:
                return "a gradient or per-sample gradient is alive at the last physical batch's start"
            odd = [name for name in _CARRIED if getattr(p, name, None) is not None and not isinstance(getattr(p, name), torch.Tensor)]
            if odd:
                return f"a parameter's {odd[0]} is not a tensor at the last physical batch's start"
        out = [(name, obj, t.key_of(v), _Meta.of(v)) for obj, name in self._attributes() for v in (getattr(obj, name),)]
        loss = self.dp.last_loss
        for what, tensors in (("held", _storages(list(self.dp.held))), ("loss", _storages(loss) if loss is not None else [])):
            for x in tensors:
                key = t.key_of(x)
                out.append((what, None, key, _standin_meta(t, key)))
        if any(key is None or meta is None for _, _, key, meta in out):
            return "a storage alive at the last physical batch's start is not logged"
        return [(what, holder, key, meta, t.category_of(key)) for what, holder, key, meta in out]

    def _attributes(self) -> list[tuple[Any, str]]:
        """(object, attribute) of every tensor Opacus keeps on a parameter or on its wrappers now."""
        out = [(p, name) for p in self.dp._params() for name in _CARRIED if isinstance(getattr(p, name, None), torch.Tensor)]
        out += [(obj, name) for obj in (self.dp.model, self.dp.optimizer, self.dp.criterion) if obj is not None
                for name, v in vars(obj).items() if isinstance(v, torch.Tensor)]
        return out

    def _replacements(self, events: list) -> "dict[int, list] | str":
        """Where, in physical batch 1's events, step n frees what step n-1 left on a parameter or wrapper
        (ghost clipping's per-sample norms, kept until the next backward replaces them): batch 2's forward
        and backward are batch 1's plus the frees of batch 1's such tensors, at the same places.
        {index in the template: [(object, attribute)]}, or why not."""
        s1, s2 = self.starts[1], self.starts[2]
        end = self.starts.get(3, self.starts[self.dp.n_physical]) if self.dp.n_physical > 2 else len(events)

        def span(a: int, b: int) -> tuple[int, int] | None:
            marks = {ev.name: j for j, ev in enumerate(events[a:b], a) if ev.kind == PHASE and ev.name in ("forward", "clip")}
            return (marks["forward"], marks["clip"]) if len(marks) == 2 else None

        one, two = span(s1, s2), span(s2, end)
        if one is None or two is None:
            return "a physical batch has no forward or no clip phase"
        made = {ev.key for ev in events[:s2] if ev.kind == ALLOC}
        held = (set(self.replaced[1]) if self.replaced else set()) | self.loss2     # freed by their own rules
        rest, at = [], {}
        for ev in events[two[0]:two[1]]:
            if ev.kind == FREE and ev.key in made:
                if ev.key in self.holders:
                    at.setdefault(len(rest), []).append(self.holders[ev.key])
                elif ev.key not in held:
                    return "physical batch 2 frees a storage of batch 1 that nothing Opacus keeps holds"
                continue
            rest.append(ev)
        # batch 1's alone: the workspaces made once and kept (cuBLAS' at the first GEMM), not a kernel's for its call
        freed_in_one = {ev.key for ev in events[one[0]:one[1]] if ev.kind == FREE}
        once = {ev.key for ev in events[one[0]:one[1]]
                if ev.kind == ALLOC and ev.category == Category.WORKSPACE and ev.key not in freed_in_one}
        first = [(j, ev) for j, ev in enumerate(events[one[0]:one[1]], one[0]) if ev.kind == PHASE or ev.key not in once]
        mods = self.tracker.log.modules
        if canonical(EventLog(events=rest, modules=mods)) != canonical(EventLog(events=[ev for _, ev in first], modules=mods)):
            return "physical batch 2's forward and backward are not batch 1's"
        return {(first[j][0] if j < len(first) else one[1]) - s1: holders for j, holders in at.items()}

    def plan(self) -> "DPRepeat | str":
        """After step 1 (the state it ends in is the state step 2 starts from)."""
        self.dp.watch = None
        k = self.dp.n_physical
        if k < 2:
            return "one physical batch per step"
        if isinstance(self.carried, str):
            return self.carried
        replace: dict = {}
        kept = self._attributes()
        if kept:      # ghost clipping's per-sample norms: step 2's first backward frees them, step 1's freed none
            replace = self._replacements(self.tracker.log.events) if 2 in self.starts else "one physical batch before the last"
            what = _name(*kept[0])
            if isinstance(replace, str):
                return f"{what} outlives the step ({replace})"
            found = {(id(obj), name) for holders in replace.values() for obj, name in holders}
            if any((id(obj), name) not in found for obj, name in kept):
                return f"{what} outlives the step and batch 2 does not replace it"
        if 1 not in self.starts or k not in self.starts or (self.dp.keep_outputs and self.held_at is None):
            return "physical batches were not marked"
        events = self.tracker.log.events
        first, last = self.starts[1], self.starts[k]
        seg = events[first:last]
        allocated: dict[Any, str] = {}
        final: dict[Any, str] = {}
        live: set = set()
        for ev in seg:
            kind = ev.kind
            if kind == ALLOC:
                allocated[ev.key] = final[ev.key] = ev.category
                live.add(ev.key)
            elif kind == FREE:
                if ev.key not in allocated:
                    return "a physical batch before the last frees a storage made before it"
                live.discard(ev.key)
            elif kind == TAG:
                if ev.key not in allocated:
                    return "a physical batch before the last tags a storage made before it"
                final[ev.key] = ev.category
        outlive = set(live)               # past step 1: one-time workspaces only
        for ev in events[last:]:
            if ev.kind == FREE:
                outlive.discard(ev.key)
        if any(final[key] != Category.WORKSPACE for key in outlive):
            return "a storage made in a physical batch before the last outlives step 1"
        carried = {c[2] for c in self.carried}
        if live - outlive != carried:
            return ("what the physical batches before the last leave alive is not the summed gradients, "
                    "the held outputs and the loss")
        held_at, order, replaced = None, [], []
        if self.dp.keep_outputs:
            # the order in which replacing the held outputs frees them, as batch 2 freed batch 1's; there the
            # previous loss (``loss.detach()``) kept the output's own loss alive, which step n's first batch
            # frees with the rest, first (a model output's first field)
            at, keys, loss = self.replaced or (0, [], set())
            freed = []
            for ev in events[at:]:
                if ev.kind != FREE:
                    break
                freed.append(ev.key)
            kept = [key for key in keys if key not in freed]
            if None in keys or len(set(freed)) != len(freed) or not set(freed) <= set(keys) or not set(kept) <= loss:
                return "replacing the held outputs does not free them all at once"
            held_at, order = self.held_at - first, [keys.index(key) for key in kept + freed]
            replaced = [keys.index(key) for key in freed + kept]
        rank = next((ev.rank for ev in seg if ev.kind == PHASE), 0)
        return DPRepeat(seg, [key for key in allocated if key not in outlive], self.carried, held_at, order, replaced, rank, k,
                        self.context, replace)


class DPRepeat:
    """Step 1's physical batches before the last, as a template for later steps (see the module docstring)."""

    WRITTEN = "physical batches before the last"       # what of step n is written (periodic.Steps.later_steps)
    UNMADE = "a stand-in for a summed gradient, held output or loss cannot be made"

    def __init__(self, segment: list[tuple], fresh: list, carried: list, held_at: int | None, order: list[int],
                 replaced: list[int], rank: int, last: int, context: tuple, replace: dict):
        self.segment, self.fresh, self.carried, self.replace = segment, fresh, carried, replace
        self.held_at, self.order, self.replaced = held_at, order, replaced    # (indices into the held storages)
        self.rank, self.last, self.context = rank, last, context

    def run(self, n: int, tracker, step, on_phase: Callable[[str], None]) -> bool:
        """Write step ``n``'s physical batches before the last into the log, then run its last one
        (``step.dp``). Returns False (nothing written) if a stand-in cannot be made."""
        dp = step.dp
        tracker.muted = True
        try:
            made = {key: meta.make() for _, _, key, meta, _ in self.carried}
        finally:
            tracker.muted = False
        if any(t is None for t in made.values()):
            return False
        remap = {key: tracker.new_key() for key in self.fresh}
        previous = [tracker.key_of(x) for x in _storages(list(dp.held))]   # step n-1's held outputs: freed below
        if self.held_at is not None and (None in previous or len(previous) != len(self.order)):
            return False
        kept = {j: [tracker.key_of(v) for v in (getattr(obj, name, None) for obj, name in holders) if v is not None]
                for j, holders in self.replace.items()}     # what step n-1 left there: freed where batch 2 freed batch 1's
        if any(None in keys for keys in kept.values()):
            return False
        out = tracker.log.events
        before = True        # until the template's first phase mark: in the phase and module the last step left
        for j, ev in enumerate(self.segment):
            if j == self.held_at:
                out.extend(Free(FREE, previous[i], self.rank) for i in self.order)
            out.extend(Free(FREE, key, self.rank) for key in kept.get(j, ()))
            kind = ev.kind
            if kind == PHASE:
                out.append(ev.at_step(n))
                before = False
                continue
            new = remap.get(ev.key)
            if new is None:
                continue            # a one-time allocation
            if kind == ALLOC and before:
                out.append(ev._replace(key=new, module=tracker.module, phase=tracker.phase))
            else:
                out.append(ev.rekeyed(new))
        _copy_layers(tracker, remap)
        for key in [*(previous if self.held_at is not None else ()), *(k for keys in kept.values() for k in keys)]:
            tracker.disown(key)

        def install() -> None:
            held, loss = [], None
            for what, holder, key, _, cat in self.carried:
                t = made[key]
                tracker.adopt(t, remap[key], cat)
                if holder is not None:
                    setattr(holder, what, t)
                elif what == "held":
                    held.append(t)
                else:
                    loss = t
            if held:   # one object, freed item by item (a tuple, last first) in the order batch 2 freed batch 1's
                dp.held[:] = [tuple(reversed([held[i] for i in self.replaced]))]
            else:
                dp.held.clear()
            dp.last_loss = loss
            made.clear()
            phase, tracker.module, tracker.category_default = self.context
            tracker.resume(phase, n)

        dp.run(on_phase, resume=(self.last, install))
        return True


def _copy_layers(tracker, remap: dict) -> None:
    """The layers (:mod:`.depth`) of the copied storages: a clip-phase allocation's layer is the tensor's it
    was computed from, not its module's, so the copies take their originals'."""
    if getattr(tracker, "live_layers", None) is not None:     # a SimulationTracker labelling layers
        tracker.copy_layers(remap)


def _name(obj, attribute: str) -> str:
    return f"a parameter's {attribute}" if isinstance(obj, torch.Tensor) else f"{type(obj).__name__}.{attribute}"
