"""Layers written from a shallow model: a stack of N identical layers from two short ones.

A decoder (or encoder) of N identical layers runs the same ops in every layer, on tensors of the
same sizes: layer j's events are layer i's with other storages. So the step of a model of N layers
is simulated on the same model cut to 3 and to 4 layers, and the log of N layers is written from
the 4-layer one: layer 1's events are copied N - 4 times, each copy placed where the next layer
runs (after layer 1 in the forward and the optimizer's per-parameter ops, before it in the
backward). Storages are matched across layers by what allocated them (op, size, category, phase
and the module inside the layer) and their order; a free or a tag of another layer's storage
keeps its distance in layers (layer j frees the hidden state of layer j - 1, the gradient from
layer j + 1).

It is checked, not assumed:

- the 4-layer log written from the 3-layer one must equal the simulated 4-layer log event for
  event (module names included), else the full model is simulated;
- every layer of the full model must be built alike (classes, parameter shapes, dtypes and
  attributes other than its index), the config must have no per-layer list whose entries differ
  (``layer_types``...), and no ``--freeze`` / ``--lora-targets`` pattern may name a layer by number.

Each event's layer is its allocation's module's layer (the optimizer's allocations take the layer
of the parameter they were computed from); a free or tag in the forward or backward belongs to
where it happens (the layer of the last allocation before it), elsewhere to the storage's layer.
A tensor made from a list with an entry per layer (``clip_grad_norm_``'s stack of norms) grows by
the bytes per layer measured between the two shallow models; a later spec of the family takes them
from its own list (one layer's entries' bytes, recorded as the tensor is made) where the family's
check showed the two equal (:func:`grows_as_recorded`).

The check on 3 and 4 layers is made once per :func:`family` (the step at any size and
accumulation); a later spec of the family is written from its 4-layer simulation alone, its
layers 1 and 2 checked alike (:func:`check_middle`). ``Simulation.later_layers`` says whether the
layers were written, how, or why the model was simulated whole.
"""
from __future__ import annotations

import bisect
import copy
import re
from dataclasses import dataclass

from ..core.events import (
    ALLOC,
    FREE,
    PHASE,
    TAG,
    Alloc,
    EventLog,
    Free,
    Tag,
    until_done,
)
from ..models import build as model_build  # a module: tests replace its _auto_class
from ..models.build import quiet
from ..models.source import ModelSource

SHALLOW = 3                # the two shallow models: SHALLOW and SHALLOW + 1 layers
TEMPLATE = 1               # the layer that is copied (its neighbours are layers on both sides)
MIN_LAYERS = 10            # below this, two shallow simulations (7 layers) save little or nothing
_POSITIONAL = ("forward", "backward")   # phases where a free belongs to where it happens


# family (see :func:`family`) -> (parameters, trainable parameters) per layer once its layers were
# written and checked on 3 and 4 layers, or why they could not be
CHECKED: dict = {}


def family(spec, source, steps: int) -> tuple:
    """What a spec's step is, its sizes (batch, sequence length, image size) and accumulation aside:
    every layer runs the same ops at any size, in every micro-batch, so whether the layers repeat
    does not change with them (what the model does outside its layers is checked once per family)."""
    d = spec.to_dict()
    for k in ("batch_size", "seq_len", "image_size", "target_len", "grad_accum", "physical_batch_size"):
        d.pop(k, None)
    config = getattr(source, "_memlens_config", None)
    if config is None:   # the config as resolved: preparing a step sets some of its fields
        config = source._memlens_config = repr(sorted(vars(source.config).items()))
    return (source.name, source.kind, config, steps, repr(sorted(d.items())))


class NotPeriodic(Exception):
    """The layers cannot be written from a shallow model (the reason is the message)."""


@dataclass
class Stack:
    """The layer stack of a model: its ModuleList's name (as the log names modules) and length."""

    label: str
    depth: int

    def layer_of(self, name: str) -> int | None:
        if not name.startswith(self.label + "."):
            return None
        head = name[len(self.label) + 1:].split(".", 1)[0]
        return int(head) if head.isdigit() else None

    def rename(self, name: str, layer: int) -> str:
        head, _, rest = name[len(self.label) + 1:].partition(".")
        return f"{self.label}.{layer}" + (f".{rest}" if rest else "")

    def suffix(self, name: str) -> str:
        return name[len(self.label) + 1:].partition(".")[2]


# ---------------------------------------------------------------- which models
def depth_of(source) -> int | None:
    """The number of layers the config sets, or None (a factory, a model without that field)."""
    cfg = getattr(source, "config", None)
    n = getattr(cfg, "num_hidden_layers", None) if cfg is not None else None
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def why_not(plan, source) -> str | None:
    """Why the step of ``plan`` (:class:`memlens.step.plan.StepPlan`) is simulated whole (None: its layers can be
    written from a shallow model)."""
    spec = plan.spec
    n = depth_of(source)
    if n is None:
        return "no num_hidden_layers in the config"
    if n < MIN_LAYERS:
        return f"{n} layers (written from shallow models from {MIN_LAYERS} on)"
    if plan.distributed and (plan.sharding.family != "fsdp" or plan.dp):
        # DDP's buckets and ZeRO-1's optimizer shards are cut by bytes over the whole model, not per layer
        return "several GPUs with DDP, ZeRO-1 or DP-SGD (FSDP2's ranks are written)"
    if getattr(spec, "pp", 1) > 1:
        return "pipeline parallel: each stage holds a slice of the layers"
    kind = plan.kind
    if not kind.layers_written:
        return "--compile" if kind.name == "compiled" else f"the {kind.name} step kind"
    if spec.checkpoint_layers is not None:   # normalized: None is all or none (memlens.core.spec)
        return "checkpointing some layers (--checkpoint-layers) makes the layers differ"
    if spec.offload_layers not in (None, "all"):
        return "offloading some layers (--offload-activations) makes the layers differ"
    if any(re.search(r"\d", p) for p in tuple(spec.freeze or ()) + tuple(spec.lora_targets or ())):
        return "a --freeze or --lora-targets pattern names layers by number"
    cfg = source.config
    for key, value in vars(cfg).items():
        if isinstance(value, (list, tuple)) and len(value) == n and len({repr(v) for v in value}) > 1:
            return f"the config's {key} differs from layer to layer"
    for sub in ("text_config", "vision_config", "encoder", "decoder"):
        if getattr(cfg, sub, None) is not None:
            return f"a config with a {sub}"
    return None


def shallow_source(source, layers: int):
    """``source`` with its config cut to ``layers`` layers (per-layer lists cut alike)."""
    cfg = copy.deepcopy(source.config)
    n = cfg.num_hidden_layers
    for key, value in list(vars(cfg).items()):
        if isinstance(value, (list, tuple)) and len(value) == n:
            setattr(cfg, key, type(value)(value[:layers]))
    cfg.num_hidden_layers = layers
    return ModelSource(source.name, source.kind, source.task, config=cfg, factory=source.factory)


def _the_stack(model, depth: int, what: str = ""):
    """(name, module) of the model's one ModuleList of ``depth`` layers of one class."""
    import torch  # heavy: torch, loaded on first use

    found = [(name, mod) for name, mod in model.named_modules()
             if isinstance(mod, torch.nn.ModuleList) and len(mod) == depth and len({type(m) for m in mod}) == 1]
    if len(found) != 1:
        raise NotPeriodic(f"{len(found)} module lists of {depth} layers{what}")
    return found[0]


def find_stack(model, depth: int, label) -> Stack:
    """The model's layer stack (``label``: the tracker's module naming, which drops peft's and
    Opacus' wrapper prefixes)."""
    return Stack(label(_the_stack(model, depth)[0]), depth)


def layer_signature(layer) -> tuple:
    """What makes two layers run the same ops: classes, parameters, buffers and plain attributes
    of every submodule, its index aside."""
    out = []
    for name, mod in layer.named_modules():
        attrs = tuple(sorted((k, repr(v)) for k, v in vars(mod).items()
                             if not k.startswith("_") and "idx" not in k and "index" not in k
                             and isinstance(v, (int, float, str, bool, tuple, type(None)))))
        params = tuple((k, tuple(p.shape), str(p.dtype), p.requires_grad) for k, p in mod.named_parameters(recurse=False))
        buffers = tuple((k, tuple(b.shape), str(b.dtype)) for k, b in mod.named_buffers(recurse=False))
        out.append((name, type(mod).__name__, attrs, params, buffers))
    return tuple(out)


def check_layers_alike(source) -> None:
    """Build the full model on the meta device and check that every layer is built alike."""
    import torch  # heavy: torch, loaded on first use

    try:
        with quiet(), torch.device("meta"):
            model = model_build._auto_class(source.task).from_config(source.config)
    except Exception as e:  # noqa: BLE001 - the whole model's simulation builds it its own way, and says why it fails
        raise NotPeriodic(f"the full model cannot be built on the meta device ({type(e).__name__})") from None
    layers = _the_stack(model, source.config.num_hidden_layers, " in the full model")[1]
    first = layer_signature(layers[0])
    for j, layer in enumerate(layers):
        if layer_signature(layer) != first:
            raise NotPeriodic(f"layer {j} is not built like layer 0")


# ---------------------------------------------------------------- the layer of each event
def layers_of(log: EventLog, stack: Stack, live: dict) -> tuple[list, dict]:
    """Each event's layer (None: outside the stack) and each key's layer.

    ``live``: key -> layer of allocations made outside the forward and backward (the optimizer's,
    recorded as they happen from the parameter each was computed from). In the forward and
    backward, a run of allocations charged to another module between two runs of one layer is
    that layer's (after a checkpointed layer's recomputation stops early, the backward's next op
    is charged to the module running before it: the layer above's); a storage of such a run freed two layers
    on is outside the stack (its events stay the layer's)."""
    module_layer = [stack.layer_of(name) for name in log.modules]
    events = log.events
    allocs: list = []            # (event index, layer, phase)
    phase = "setup"
    for i, ev in enumerate(events):
        if ev.kind == PHASE:
            phase = ev.name
        elif ev.kind == ALLOC:
            lay = module_layer[ev.module] if ev.module >= 0 else None
            allocs.append([i, lay if lay is not None else live.get(ev.key), phase])
    runs: list = []              # [first, last] positions in allocs of runs of one layer and phase
    for r, a in enumerate(allocs):
        if runs and allocs[runs[-1][0]][1:] == a[1:]:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    freed = {ev.key: i for i, ev in enumerate(events) if ev.kind == FREE}
    adopted: list = []           # (key, layer) of storages given the layer of the runs around them
    for q in range(1, len(runs) - 1):
        prev, cur, nxt = (allocs[runs[x][0]] for x in (q - 1, q, q + 1))
        if (prev[1] is not None and prev[1:] == nxt[1:] and cur[2] == prev[2] != "setup"
                and (cur[1] is None or cur[2] in _POSITIONAL)):
            unowned = cur[1] is None
            for r in range(runs[q][0], runs[q][1] + 1):
                allocs[r][1] = prev[1]
                if unowned and events[allocs[r][0]].key in freed:
                    adopted.append((events[allocs[r][0]].key, prev[1]))
    # but an adopted storage freed two layers on is not one of that layer's temporaries (the residual stream's gradient summed
    # into in place down the stack, made at its top while the hooks of the layers around ran): outside the stack
    at = [a[0] for a in allocs]
    far = {key for key, lay in adopted if (f := bisect.bisect_left(at, freed[key]) - 1) >= 0
           and allocs[f][1] is not None and abs(allocs[f][1] - lay) >= 2}
    key_layer = {events[i].key: (None if events[i].key in far else lay) for i, lay, _ in allocs}
    alloc_layer = {i: lay for i, lay, _ in allocs}
    owner: list = []
    phase = "setup"
    last = None
    for i, ev in enumerate(events):
        kind = ev.kind
        if kind == ALLOC:
            last = alloc_layer[i]
            owner.append(last)
        elif kind == PHASE:
            phase = ev.name
            owner.append(None)
        elif phase in _POSITIONAL and last is not None:
            owner.append(last)
        else:
            owner.append(key_layer.get(ev.key))
    _absorb(owner, events, key_layer)
    return owner, key_layer


def _absorb(owner: list, events: list, key_layer: dict) -> None:
    """A run of events outside the stack between two runs of one layer or of two neighbours, in one
    phase, is the second one's: within a layer, an optimizer's per-parameter work (its step
    counter); between neighbours, work that every layer does first (or last: the same events,
    owned one layer on). Only a run before an allocation, and outside forward and backward only
    one that allocates: frees alone there are owned by what they free (a list of every
    parameter's tensors dies in one go)."""
    phase = ["setup"] * len(events)
    cur = "setup"
    kinds = [ev.kind for ev in events]
    for i, ev in enumerate(events):
        if ev.kind == PHASE:
            cur = ev.name
        phase[i] = cur
    i, n = 0, len(owner)
    while i < n:
        if owner[i] is not None or i == 0 or kinds[i] == PHASE:
            i += 1
            continue
        j = i
        while j < n and owner[j] is None and kinds[j] != PHASE:
            j += 1
        x, y = owner[i - 1], owner[j] if j < n else None
        if (x is not None and y is not None and abs(x - y) <= 1 and phase[i - 1] == phase[j] != "setup"
                and kinds[j] == ALLOC and (phase[j] in _POSITIONAL or ALLOC in kinds[i:j])):
            for q in range(i, j):
                owner[q] = owner[j]
                if kinds[q] == ALLOC:
                    key_layer[events[q].key] = owner[j]
        i = j
    for q, ev in enumerate(events):     # frees and tags owned by what they free: its layer may have moved above
        if ev.kind in (FREE, TAG) and phase[q] not in _POSITIONAL:
            owner[q] = key_layer.get(ev.key)
    # frees of another layer's storages between two allocations of one layer (a per-parameter loop
    # freeing the previous parameter's scratch at the next one) happen where they happen
    starts = [0] + [i for i in range(1, n) if owner[i] != owner[i - 1] or kinds[i] == PHASE or kinds[i - 1] == PHASE]
    bounds = list(zip(starts, starts[1:] + [n]))
    for b in range(1, len(bounds) - 1):
        (s0, _), (s1, e1), (s2, _) = bounds[b - 1], bounds[b], bounds[b + 1]
        y = owner[s0]
        if (y is not None and owner[s2] == y and owner[s1] is not None and owner[s1] != y and phase[s0] == phase[s1] == phase[s2]
                and phase[s1] not in _POSITIONAL and all(kinds[q] in (FREE, TAG) for q in range(s1, e1))
                and kinds[e1] == ALLOC):
            for q in range(s1, e1):
                owner[q] = y


# ---------------------------------------------------------------- writing N layers
def _tokens(log: EventLog, stack: Stack, key_layer: dict) -> tuple[dict, dict]:
    """Each layer key's place in its layer, as (what allocated it, occurrence), and back."""
    place: dict = {}
    back: dict = {}
    seen: dict = {}
    phase = "setup"
    for ev in log.events:
        if ev.kind == PHASE:
            phase = ev.name
            continue
        if ev.kind != ALLOC:
            continue
        lay = key_layer.get(ev.key)
        if lay is None:
            continue
        name = log.modules[ev.module] if ev.module >= 0 else ""
        m = stack.layer_of(name)
        where = name if m is None else (m - lay, stack.suffix(name))
        token = (phase, ev.nbytes, ev.category, where, ev.phase, str(ev.op), ev.stream)
        occ = seen.get((lay, token), 0)
        seen[(lay, token)] = occ + 1
        place[ev.key] = (token, occ)
        back[(lay, token, occ)] = ev.key
    return place, back


def grown_sizes(log_a: EventLog, spanning_a: dict, log_b: EventLog, spanning_b: dict, copies: int) -> tuple[dict, dict]:
    """Sizes, with one layer more (of ``log_a``'s keys) and with ``copies`` layers more (of
    ``log_b``'s), of the allocations made from a list with an entry per layer. Each grows by its
    size in ``log_b`` (one layer more) less its size in ``log_a``: the list gains one layer's
    entries, each adding the same bytes."""
    a, b = (_spanning(log, sp) for log, sp in ((log_a, spanning_a), (log_b, spanning_b)))
    if [t for _, t, _ in a] != [t for _, t, _ in b]:
        raise NotPeriodic("the allocations made from every layer's tensors differ between the shallow models")
    per = [sb - sa for (_, _, sa), (_, _, sb) in zip(a, b)]
    if any(g < 0 for g in per):
        raise NotPeriodic("an allocation made from every layer's tensors shrinks with more layers")
    return ({k: size + g for (k, _, size), g in zip(a, per)}, {k: size + copies * g for (k, _, size), g in zip(b, per)})


def grows_as_recorded(log_a: EventLog, spanning_a: dict, log_b: EventLog, spanning_b: dict) -> bool:
    """Whether each allocation made from every layer's tensors grew from the 3- to the 4-layer model by
    the bytes the simulation recorded for one layer's entries (the same in both): then a later spec of
    the family sizes them from its 4-layer simulation alone (:func:`recorded_sizes`). Call after
    :func:`grown_sizes` (the two lists alike)."""
    return all(spanning_a[ka] is not None and spanning_a[ka] == spanning_b[kb] == sb - sa
               for (ka, _, sa), (kb, _, sb) in zip(_spanning(log_a, spanning_a), _spanning(log_b, spanning_b)))


def recorded_sizes(log: EventLog, spanning: dict, copies: int) -> dict:
    """Sizes, with ``copies`` layers more, of the allocations made from every layer's tensors, each grown by
    the bytes the simulation recorded for one layer's entries (shown to hold for the family: :func:`grows_as_recorded`)."""
    return {k: size + copies * spanning[k] for k, _, size in _spanning(log, spanning)}


def _spanning(log: EventLog, spanning: dict) -> list:
    """(key, what allocated it, size) of the allocations made from every layer's tensors, in order."""
    return [(ev.key, (ev.category, ev.phase, str(ev.op), ev.stream), ev.nbytes)
            for ev in log.events if ev.kind == ALLOC and ev.key in spanning]


def write_layers(log: EventLog, stack: Stack, live: dict, copies: int, template: int = TEMPLATE,
                 sizes: dict | None = None, keys: dict | None = None) -> EventLog:
    """The log of the same step with ``copies`` more layers, copies of layer ``template``, up to
    "done" (``sizes``: key -> size with the new layers, of allocations made from every layer's
    tensors). ``keys``, if given, is filled with (copy, key of the template's storage) -> the
    copy's key (the storages of the template's own events keep their keys)."""
    if copies < 1:
        raise ValueError("copies must be >= 1")
    if not 0 < template < stack.depth - 1:
        raise NotPeriodic(f"layer {template} of {stack.depth} has no layer on each side")
    log = EventLog(events=until_done(log.events), modules=log.modules, rank=log.rank)
    writer = _LayerWriter(log, stack, live, template, copies, sizes, {} if keys is None else keys)
    writer.write()
    return writer.out


class _LayerWriter:
    """Writes ``log`` with ``copies`` more layers (:func:`write_layers`): layers above the template
    are renumbered, the template's events are written once more per copy, with fresh keys."""

    def __init__(self, log: EventLog, stack: Stack, live: dict, template: int, copies: int, sizes: dict | None,
                 fresh: dict):
        self.log, self.stack, self.t, self.k, self.sizes, self.fresh = log, stack, template, copies, sizes, fresh
        self.owner, self.key_layer = layers_of(log, stack, live)
        self.place, self.back = _tokens(log, stack, self.key_layer)
        self.out = EventLog(rank=log.rank)
        self.module_layer = [stack.layer_of(name) for name in log.modules]
        self.module_ids = self._name_modules()
        self.module_at: dict = {}     # (module, the event's layer, where it is written) -> module id written
        self.next_key = max((ev.key for ev in log.events if ev.kind == ALLOC and isinstance(ev.key, int)), default=-1) + 1

    def new(self, j):
        """Where source layer ``j`` is written (layers above the template move up by the copies)."""
        return j if j is None or j <= self.t else j + self.k

    def _name_modules(self) -> dict:
        """The new log's module ids of the source's modules: each run of the template's names
        followed by its copies' (named_modules order; an allocation looks its module up by name)."""
        names, stack, out, t = self.log.modules, self.stack, self.out, self.t
        ids: dict = {}
        i = 0
        while i < len(names):
            lay = stack.layer_of(names[i])
            if lay is None:
                ids[i] = out.module_id(names[i])
                i += 1
                continue
            run = []
            while i < len(names) and stack.layer_of(names[i]) == lay:
                run.append(i)
                i += 1
            for m in run:
                ids[m] = out.module_id(stack.rename(names[m], self.new(lay)))
            if lay == t:
                for c in range(1, self.k + 1):
                    for m in run:
                        out.module_id(stack.rename(names[m], t + c))
        return ids

    def copy_key(self, c: int, key):
        """The key of copy ``c`` of the template's storage ``key``."""
        got = self.fresh.get((c, key))
        if got is None:
            got = self.fresh[(c, key)] = self.next_key
            self.next_key += 1
        return got

    def resolve(self, key, src_layer, at_layer):
        """The key an event of source layer ``src_layer`` written as layer ``at_layer`` refers to."""
        j = self.key_layer.get(key)
        if j is None:
            return key
        t, k = self.t, self.k
        target = self.new(j) if src_layer is None else at_layer + (j - src_layer)
        if t < target <= t + k:
            c, orig = target - t, t
        else:
            c, orig = 0, target if target <= t else target - k
        if orig == j and c == 0:
            return key
        token, occ = self.place[key]
        found = self.back.get((orig, token, occ))
        if found is None:
            raise NotPeriodic(f"layer {j}'s storage has no counterpart in layer {orig}")
        return self.copy_key(c, found) if c else found

    def module_written(self, module: int, lay, at) -> int:
        """The module id an allocation of ``module`` by an event of layer ``lay`` written as layer ``at`` gets."""
        got = self.module_at.get((module, lay, at))
        if got is None:
            m = self.module_layer[module]
            if m is None:
                got = self.module_ids[module]
            else:    # the module's layer, at the same distance from the event's layer
                got = self.out.module_id(self.stack.rename(self.log.modules[module], self.new(m) if lay is None else at + (m - lay)))
            self.module_at[(module, lay, at)] = got
        return got

    def emit(self, evs, lay, c: int) -> None:
        """Write the events ``evs`` (of source layer ``lay``) as copy ``c`` of them (0: themselves, renumbered)."""
        at = self.new(lay) if c == 0 else self.t + c
        grown = self.sizes if self.sizes and c == 0 else None     # (its keys: the allocations made from every layer's tensors)
        fresh, resolve, module_at, module_written = self.fresh, self.resolve, self.module_at, self.module_written
        append = self.out.events.append
        make = tuple.__new__      # Alloc(...), Free(...), Tag(...) without their constructors' call
        for ev in evs:
            kind = ev.kind
            if kind == ALLOC:
                key = ev.key
                if c:
                    key = fresh.get((c, key))
                    if key is None:
                        key = self.copy_key(c, ev.key)
                module = ev.module
                if module >= 0:
                    got = module_at.get((module, lay, at))
                    module = got if got is not None else module_written(module, lay, at)
                nbytes = grown.get(ev.key, ev.nbytes) if grown else ev.nbytes
                append(make(Alloc, (ALLOC, key, nbytes, ev.category, module, ev.phase, ev.op, ev.rank, ev.stream)))
            elif kind == FREE:
                append(make(Free, (FREE, resolve(ev.key, lay, at), ev.rank)))
            elif kind == TAG:
                append(make(Tag, (TAG, resolve(ev.key, lay, at), ev.category, ev.rank)))
            else:
                append(ev)

    def write(self) -> None:
        """Each run of one layer's events (None included) written in order; the template's runs with
        their copies after them (where layer t + 1 follows, the forward) or before (the backward)."""
        events, owner, t, k = self.log.events, self.owner, self.t, self.k
        n = len(events)
        starts = [0] + [i for i in range(1, n) if owner[i] != owner[i - 1]]
        blocks = [(s, e, owner[s]) for s, e in zip(starts, starts[1:] + [n])]
        layered = [b for b in range(len(blocks)) if blocks[b][2] is not None]
        pos = {b: r for r, b in enumerate(layered)}
        for b, (s, e, lay) in enumerate(blocks):
            if lay != t:
                self.emit(events[s:e], lay, 0)
                continue
            r = pos[b]
            after = r + 1 < len(layered) and blocks[layered[r + 1]][2] == t + 1
            before = r > 0 and blocks[layered[r - 1]][2] == t + 1
            if after == before:
                raise NotPeriodic(f"layer {t}'s events at {s} have no layer {t + 1} on one side")
            order = [0] + list(range(1, k + 1)) if after else list(range(k, 0, -1)) + [0]
            for c in order:
                self.emit(events[s:e], lay, c)


def check_middle(log: EventLog, stack: Stack, live: dict, template: int = TEMPLATE) -> None:
    """Layer ``template + 1``, a middle layer too, must be layer ``template``'s events written one
    layer on: block for block, each storage of layer j taken as its counterpart in layer j + 1."""
    t, u = template, template + 1
    if not (0 < t and u < stack.depth - 1):
        raise NotPeriodic(f"layers {t} and {u} of {stack.depth} are not both between two layers")
    log = EventLog(events=until_done(log.events), modules=log.modules, rank=log.rank)
    owner, key_layer = layers_of(log, stack, live)
    place, back = _tokens(log, stack, key_layer)
    ids = {name: i for i, name in enumerate(log.modules)}

    def moved(key):
        j = key_layer.get(key)
        if j is None:
            return key
        found = back.get((j + 1, *place[key]))
        if found is None:
            raise NotPeriodic(f"layer {j}'s storage has no counterpart in layer {j + 1}")
        return found

    def one_on(ev):
        kind = ev.kind
        if kind == ALLOC:
            module = ev.module
            m = stack.layer_of(log.modules[module]) if module >= 0 else None
            if m is not None:
                module = ids.get(stack.rename(log.modules[module], m + 1), -2)
            return ev._replace(key=moved(ev.key), module=module)
        if kind in (FREE, TAG):
            return ev.rekeyed(moved(ev.key))
        return ev

    events, n = log.events, len(log.events)
    starts = [0] + [i for i in range(1, n) if owner[i] != owner[i - 1]]
    blocks = list(zip(starts, starts[1:] + [n]))
    mine = [(s, e) for s, e in blocks if owner[s] == t]
    theirs = [(s, e) for s, e in blocks if owner[s] == u]
    if len(mine) != len(theirs):
        raise NotPeriodic(f"layers {t} and {u} run in {len(mine)} and {len(theirs)} stretches")
    for (s, e), (s2, e2) in zip(mine, theirs):
        if [one_on(ev) for ev in events[s:e]] != events[s2:e2]:
            raise NotPeriodic(f"layer {u}'s events at {s2} are not layer {t}'s written one layer on")
