"""Opacus as memlens' DP-SGD engine (``--dp``): the model, optimizer and data loader wrapped by
Opacus' own ``PrivacyEngine.make_private``, the logical batch split by Opacus' own
``BatchMemoryManager``, and the step a DP-SGD user writes around them.

The same :class:`DPStep` runs on fake CPU tensors (``estimate``) and on a real device
(``profile``, the measured trials of compare / sweep / fit, the bench), so an estimate and a
measurement are the same code. What Opacus allocates, all of it by running its own code:

- ``grad_sample_mode="hooks"`` (``GradSampleModule``): a forward hook keeps each trainable layer's
  input; in backward the layer's grad sampler computes the per-sample gradients (``einsum`` into
  physical batch x parameter shape), copied into a zero-filled ``p.grad_sample`` buffer of the same
  size; the ordinary ``p.grad`` is computed too. ``DPOptimizer.step`` clips them
  (``clip_and_accumulate``: per-sample norms, then an ``einsum`` into one parameter-sized tensor
  added to ``p.summed_grad``).
- ``grad_sample_mode="ghost"`` (``GradSampleModuleFastGradientClipping`` + ``DPLossFastGradientClipping``):
  ``loss.backward()`` runs two backward passes, the first with ``retain_graph=True`` (every saved
  activation lives through both); in the first, each ``nn.Linear``'s norm sampler builds the
  physical batch x T x T Gram matrices of its output gradients and inputs for sequence inputs
  (so ghost can cost more than hooks at long T); layers without a norm sampler materialize their
  per-sample gradients for a moment. ``DPOptimizerFastGradientClipping.step`` copies ``p.grad``
  into ``p.summed_grad``.
- either way, the last physical batch of a logical batch adds noise (``torch.normal`` into a
  parameter-sized tensor next to a zero-filled one), replaces ``p.grad`` by ``summed_grad + noise``
  and steps the wrapped optimizer; the other physical batches only clip and accumulate
  (``signal_skip_step``), and ``zero_grad`` drops the per-sample gradients.

What cannot run on fake tensors, and what memlens does instead (docs/dp-sgd.md says the same):

- ``DataLoader`` iteration draws its base seed with ``.item()``, which a fake tensor cannot answer:
  on fake tensors memlens iterates the BatchMemoryManager's own ``BatchSplittingSampler`` (which
  signals the optimizer exactly as the data loader would) and calls the loader's collate function.
- ``DPOptimizerFastGradientClipping.accumulate`` calls ``copy.deepcopy(p.grad.data)``, which on a
  fake tensor makes a tensor of another fake mode: on fake tensors ``deepcopy`` of a tensor is run
  as ``clone()`` (a new storage of the same size, what deepcopy allocates on a GPU).

The dataset is the spec's logical batch on the host (random tokens or pixels); each physical batch
is gathered and copied to the device as a DP-SGD training loop does. ``poisson_sampling=False``:
every logical batch has exactly ``--batch-size`` samples (Poisson sampling draws a random batch
size each step; memory follows the physical batch). The privacy accountant is Opacus' default.

Distributed DP-SGD: :func:`make_private` takes the rank's already-wrapped module, and Opacus picks
its distributed optimizer from the module type. ``--dp --sharding ddp`` wraps in Opacus' DPDDP
(:mod:`memlens.step.parallel.dpddp`); ``--dp --grad-sample-mode ghost --sharding fsdp`` wraps in
Opacus' FSDP2Wrapper (:mod:`memlens.step.parallel.dp_fsdp`) and runs ``grad_sample_mode="ghost_fsdp"``.
Ghost clipping's backward phase holds two passes; :attr:`DPStep.passes` marks where "backward 1"
(per-sample norms, ``retain_graph=True``) and "backward 2" (the re-weighted loss) start.
"""
from __future__ import annotations

import contextlib
import importlib
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

from ...core.enums import Category
from ...core.errors import MemlensError, SpecError
from ...core.precision import precision_of
from ..loop import held_part, loss_of, shifted_logits

PER_SAMPLE = Category.PER_SAMPLE_GRADIENTS.value
GRAM = Category.GRAM_MATRICES.value
GRADIENTS = Category.GRADIENTS.value
INPUTS = Category.INPUTS.value
MIN_VERSION = (1, 5, 3)   # make_private returns the DPLossFastGradientClipping criterion for ghost clipping
GHOST_TASKS = ("causal-lm", "masked-lm", "image-classification", "factory")


def require_opacus():
    """The opacus module, or one clear line saying how to install it."""
    try:
        import opacus  # optional: opacus (memlens[dp])
    except ImportError:
        raise MemlensError("--dp runs Opacus (DP-SGD), which is not installed", hint="pip install 'memlens[dp]'") from None
    version = tuple(int(x) for x in opacus.__version__.split("+")[0].split(".")[:3] if x.isdigit())
    if version < MIN_VERSION:
        raise MemlensError(f"--dp needs opacus >= {'.'.join(map(str, MIN_VERSION))}, found {opacus.__version__}",
                           hint="pip install -U 'memlens[dp]'")
    return opacus


# ---------------------------------------------------------------- the dataset: the logical batch on the host
class SampleIndices:
    """A map-style dataset whose items are sample indices; :class:`Gather` turns a list of them into a batch."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return int(i)


class Gather:
    """The collate function: the samples ``indices`` of the host batch, as new tensors (one per
    tensor of the batch: ``labels`` that is ``input_ids`` stays one tensor; a tensor that is not per
    sample is copied whole). On fake tensors the new tensor stands for the device copy (the dataset
    itself is on the host: never counted); on a real device :meth:`to_device` copies it over."""

    def __init__(self, batch: Any, n: int):
        self.batch = batch
        self.n = n

    def __call__(self, indices: list[int]) -> Any:
        import torch  # heavy: torch, loaded on first use
        from torch.utils._pytree import tree_map  # heavy: torch, loaded on first use

        idx = [int(i) for i in indices]
        lo, hi = idx[0], idx[-1] + 1
        contiguous = idx == list(range(lo, hi))
        memo: dict[int, Any] = {}

        def take(t):
            if not isinstance(t, torch.Tensor):
                return t
            if t.dim() == 0 or t.shape[0] % self.n:       # not per sample: a copy all the same (the data loader's)
                if id(t) not in memo:
                    memo[id(t)] = t.clone()
                return memo[id(t)]
            if id(t) not in memo:
                k = t.shape[0] // self.n     # rows per sample (VLMs: images per sample)
                if contiguous:
                    memo[id(t)] = t[lo * k:hi * k].clone()
                else:
                    rows = torch.tensor([i * k + j for i in idx for j in range(k)], dtype=torch.long)
                    memo[id(t)] = t.index_select(0, rows)
            return memo[id(t)]

        return tree_map(take, self.batch)

    @staticmethod
    def to_device(batch: Any, device) -> Any:
        import torch  # heavy: torch, loaded on first use
        from torch.utils._pytree import tree_map  # heavy: torch, loaded on first use

        memo: dict[int, Any] = {}

        def move(t):
            if not isinstance(t, torch.Tensor) or t.device == device:
                return t
            if id(t) not in memo:
                memo[id(t)] = t.to(device)
            return memo[id(t)]

        return tree_map(move, batch)


# ---------------------------------------------------------------- losses
class FactoryCriterion:
    """A factory's ``loss_fn(out, batch)`` as the criterion Opacus' ghost clipping wraps: it must
    return one loss per sample (Opacus asks for ``reduction="none"``)."""

    def __init__(self, loss_fn: Callable, name: str):
        self.loss_fn = loss_fn
        self.name = name
        self.reduction = "mean"

    def __call__(self, out, batch):
        loss = self.loss_fn(out, batch)
        if getattr(loss, "dim", lambda: 0)() != 1:
            raise MemlensError(f"ghost clipping needs one loss per sample, and {self.name}'s loss function returns "
                               f"shape {tuple(getattr(loss, 'shape', ()))}",
                               hint="return the per-sample losses (shape [batch]) from the factory's loss, or use --grad-sample-mode hooks")
        if self.reduction == "mean":
            return loss.mean()
        return loss


def _hf_per_sample_loss(criterion, task: str, out, batch):
    """Hugging Face's own loss (transformers.loss.loss_utils: ForCausalLMLoss / ForMaskedLMLoss /
    sequence classification), per sample, through Opacus' DPLossFastGradientClipping ``criterion``:
    logits upcast to fp32, labels shifted for causal LMs (padded with -100), flattened, then
    cross-entropy per token reduced per sample (``shape=(B, T)``)."""
    import torch  # heavy: torch, loaded on first use

    logits = out.logits
    labels = batch["labels"]
    if task in ("causal-lm", "masked-lm"):
        logits = logits.float()
        if task == "causal-lm":
            labels = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
        B, T, V = logits.shape
        return criterion(logits.view(-1, V), labels.view(-1), shape=(B, T))
    return criterion(logits.view(logits.shape[0], -1), labels.view(-1))


# ---------------------------------------------------------------- the step
@dataclass
class DPStep:
    """One DP-SGD optimizer step = the physical batches of one logical batch, as Opacus runs them."""

    model: Any                        # GradSampleModule (hooks) / GradSampleModuleFastGradientClipping (ghost)
    optimizer: Any                    # DPOptimizer / DPOptimizerFastGradientClipping
    criterion: Any                    # DPLossFastGradientClipping (ghost) or None
    data_loader: Any                  # the loader make_private returned (one logical batch per epoch)
    loader: Any                       # BatchMemoryManager's loader over it (physical batches)
    privacy_engine: Any
    gather: Gather
    device: Any
    fake: bool
    mode: str
    task: str
    logical_batch: int
    physical_batch: int
    loss_fn: Callable | None = None
    autocast: Callable[[], Any] = contextlib.nullcontext
    functorch_layers: list[str] = field(default_factory=list)   # trainable layer types Opacus handles with functorch
    loss_kind: str = "model"          # spec.loss: the model's own loss, or the user's criterion on shifted logits
    keep_outputs: bool = False        # the loop holds the outputs (`logits = model(x).logits`) through backward
    held: list = field(default_factory=list)   # what it holds: replaced when the next forward returns
    observer: Any = None              # .retag(tensor, category) and .scope(category): the estimate's tracker or the profiler
    physical: tuple[int, int] = (0, 0)  # the physical batch running now: (number, of how many)
    current_pass: str = ""            # "forward", "backward 1", "backward 2" (ghost clipping's re-weighted pass), "clip"
    runs: int = 0                     # optimizer steps run so far
    passes: list = field(default_factory=list)   # (run, physical batch, pass, event index in the observer's log)
    # on fake tensors: told ("batch", i) before physical batch i is gathered and ("held", i) before its outputs
    # replace the held ones (memlens.estimator.periodic_dp writes later steps from the first with it)
    watch: Callable[[str, int], None] | None = None
    last_loss: Any = None             # the last physical batch's loss (detached) while the step runs
    _on_phase: Callable[[str], None] = field(default=lambda name: None, repr=False)

    @property
    def original_optimizer(self):
        """The torch optimizer inside the DPOptimizer: its ``step`` runs once per logical batch."""
        return self.optimizer.original_optimizer

    @property
    def n_physical(self) -> int:
        return -(-self.logical_batch // self.physical_batch)

    def physical_batches(self, resume: tuple[int, Callable[[], None]] | None = None):
        """The physical batches of one logical batch, from BatchMemoryManager's sampler.

        On fake tensors a physical batch that is neither the first two nor the last, and has the
        size of the one before, is not re-run: it starts from the state the one before left
        (``summed_grad`` accumulated, the step skipped) and allocates the same, so memory repeats.
        Its skip signal is consumed as its ``optimizer.step()`` would have. ``resume`` (fake tensors):
        (i, install): the batches before i were written into the log by the caller; their skip
        signals are consumed, then ``install()`` puts the state they leave in place, and batch i runs."""
        if self.fake:
            k, prev = self.n_physical, None
            for i, idx in enumerate(self.loader.batch_sampler, 1):
                if resume is not None and i < resume[0] or 2 < i < k and len(idx) == prev:
                    self.optimizer._check_skip_next_step()
                    self.optimizer._is_last_step_skipped = True
                    prev = len(idx)
                    continue
                if resume is not None and i == resume[0]:
                    resume[1]()
                prev = len(idx)
                if self.watch is not None:
                    self.watch("batch", i)
                yield i, self.gather(idx)
        else:
            for i, b in enumerate(self.loader, 1):
                yield i, self.gather.to_device(b, self.device)

    def run(self, on_phase: Callable[[str], None] = lambda name: None, resume: tuple[int, Callable[[], None]] | None = None):
        """Every physical batch: forward, backward (two passes under ghost clipping), the DP
        optimizer's step ("clip": clip and accumulate; on the last physical batch also noise, then
        "optimizer": the wrapped optimizer's update), zero_grad. Returns the last loss (None on fake
        tensors). ``resume``: see :meth:`physical_batches`."""
        self._on_phase = on_phase
        self.runs += 1
        with warnings.catch_warnings():
            # PyTorch's note that a module hook fires on outputs when no input needs a gradient (a
            # frozen embedding before the first adapter): what Opacus relies on, not a problem
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            return self._run(on_phase, resume)

    def _run(self, on_phase, resume):
        try:
            k = self.n_physical
            for i, batch in self.physical_batches(resume):
                self.physical = (i, k)
                self._tag(_tensors(batch), INPUTS)
                on_phase("forward")
                self._pass("forward")
                with self.autocast():
                    loss = self._loss(batch)
                on_phase("backward")
                self._pass("backward 1")
                with self._second_pass_marked():
                    loss.backward()
                self.last_loss = loss.detach()
                del loss
                on_phase("clip")
                self._pass("clip")
                self._tag(self._per_sample_tensors(), PER_SAMPLE)
                with self._fake_deepcopy(), self._noise_layers():
                    self.optimizer.step()          # the last physical batch enters "optimizer" through the hook
                self._tag([t for p in self._params() for t in (p.grad, getattr(p, "summed_grad", None)) if t is not None],
                          GRADIENTS)
                self.optimizer.zero_grad(set_to_none=True)
                del batch                          # the physical batch lives through its step, as in a training loop
            on_phase("end")
        finally:
            self._on_phase = lambda name: None
            self.physical = (0, 0)
            last, self.last_loss = self.last_loss, None
        if last is None or self.fake:
            return None
        return last

    # -- pieces
    def _pass(self, name: str) -> None:
        """Mark where a pass starts (the phases stay forward / backward / clip; ghost clipping's
        backward phase holds two passes, told apart here)."""
        self.current_pass = name
        log = getattr(self.observer, "log", None)
        if log is not None:
            self.passes.append((self.runs, self.physical[0], name, len(log.events)))

    def _second_pass_marked(self):
        """Under ghost clipping ``DPTensorFastGradientClipping.backward`` turns the hooks off right
        before its second (re-weighted) backward: that call marks "backward 2"."""
        if self.criterion is None or not hasattr(self.model, "disable_hooks"):
            return contextlib.nullcontext()
        model, plain = self.model, self.model.disable_hooks

        @contextlib.contextmanager
        def marked():
            def disable_hooks():
                self._pass("backward 2")
                return plain()
            model.disable_hooks = disable_hooks
            try:
                yield
            finally:
                del model.disable_hooks
        return marked()

    def _loss(self, batch):
        out = self._forward(batch)
        if self.keep_outputs:      # the user's `logits = model(x).logits`: the previous physical batch's go now
            if self.watch is not None:
                self.watch("held", self.physical[0])
            self.held[:] = [held_part(out, self.loss_fn)]
        return self._loss_from(out, batch)

    def _forward(self, batch):
        if isinstance(batch, dict):
            if self.criterion is not None and self.task != "factory" or self.loss_kind != "model":
                batch = {k: v for k, v in batch.items() if k != "labels"}    # the loss is taken outside the model
            return self.model(**batch)
        return self.model(*batch) if isinstance(batch, (tuple, list)) else self.model(batch)

    def _loss_from(self, out, batch):
        if self.criterion is None:                     # hooks: the model's own loss, the factory's or the user's criterion
            return loss_of(out, batch, self.loss_fn)
        if self.task == "factory":
            return self.criterion(out, batch)
        if self.loss_kind != "model":                  # ghost: the user's criterion per sample, on the shifted logits
            x, target = shifted_logits(out, batch, fp32=self.loss_kind == "criterion-fp32")
            B, T = batch["labels"].shape[:2]
            return self.criterion(x, target, shape=(B, T - 1))
        return _hf_per_sample_loss(self.criterion, self.task, out, batch)

    def _params(self):
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _per_sample_tensors(self) -> list:
        out = []
        for p in self._params():
            for name in ("grad_sample", "_current_grad_sample", "_norm_sample"):
                v = getattr(p, name, None)
                out.extend(v if isinstance(v, list) else [v] if v is not None else [])
        if self.mode == "ghost_fsdp":       # the FSDP hooks keep the norms on the module
            for m in self.model.modules():
                out.extend(t for t in getattr(m, "norm_sample", None) or () if t is not None)
        return out

    def _tag(self, tensors, category: str) -> None:
        obs = self.observer
        if obs is None:
            return
        tensors = [getattr(t, "_local_tensor", t) for t in tensors]    # a DTensor's memory is its shard
        if hasattr(obs, "retag_all"):            # the profiler: one observation for them all
            obs.retag_all(list(tensors), category)
            return
        for t in tensors:
            obs.retag(t, category)

    def _scoped(self, fn, category: str):
        def sampler(module, activations, backprops):
            obs = self.observer
            if obs is None:
                return fn(module, activations, backprops)
            with obs.scope(category):
                return fn(module, activations, backprops)

        return sampler

    def _fake_deepcopy(self):
        return _deepcopy_as_clone() if self.fake else contextlib.nullcontext()

    def _noise_layers(self):
        """On fake tensors, with an observer that places allocations in layers (the estimate's tracker, for
        memlens.estimator.depth): Opacus' noise for a parameter, made from its shape alone, is placed in
        the parameter's layer. Nothing else changes: Opacus' own ``_generate_noise`` runs."""
        layer_from = getattr(self.observer, "layer_from", None)
        if not self.fake or layer_from is None:
            return contextlib.nullcontext()
        return _noise_from_reference(layer_from)


def _tensors(batch) -> list:
    import torch  # heavy: torch, loaded on first use
    from torch.utils._pytree import tree_flatten  # heavy: torch, loaded on first use

    return [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]


@contextlib.contextmanager
def _noise_from_reference(layer_from):
    """Opacus' ``_generate_noise(std, reference, ...)`` run inside ``layer_from(reference)``, in every
    optimizer module that calls it."""


    mods = []
    for name in ("optimizer", "optimizer_fast_gradient_clipping", "fsdpoptimizer_fast_gradient_clipping", "ddpoptimizer"):
        try:
            m = importlib.import_module(f"opacus.optimizers.{name}")
        except ImportError:
            continue
        if hasattr(m, "_generate_noise"):
            mods.append(m)
    saved = [(m, m._generate_noise) for m in mods]

    def make(fn):
        def generate(std, reference, *a, **k):
            with layer_from(reference):
                return fn(std, reference, *a, **k)
        return generate

    for m, fn in saved:
        m._generate_noise = make(fn)
    try:
        yield
    finally:
        for m, fn in saved:
            m._generate_noise = fn


def _deepcopy_as_clone():
    import torch  # heavy: torch, loaded on first use
    from torch.overrides import TorchFunctionMode  # heavy: torch, loaded on first use

    class DeepcopyAsClone(TorchFunctionMode):
        """``copy.deepcopy(tensor)`` as ``tensor.clone()``: the same new storage, in the same fake mode."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.__deepcopy__:
                t, memo = args
                out = memo[id(t)] = t.clone()
                return out
            return func(*args, **(kwargs or {}))

    return DeepcopyAsClone()


# ---------------------------------------------------------------- what this step can run
def check_spec(spec, task: str) -> None:
    """One clear line for DP-SGD settings this step cannot run (before any model is built)."""
    require_opacus()
    if spec.grad_accum > 1:
        raise SpecError("--grad-accum with --dp: DP-SGD accumulates through Opacus' BatchMemoryManager",
                        hint=f"use --batch-size {spec.batch_size * spec.grad_accum} --physical-batch-size {spec.batch_size}")
    if spec.grad_checkpointing:
        raise SpecError("--grad-checkpointing with --dp: Opacus' hooks see each checkpointed layer's forward twice "
                        "(the recomputation) and lose its per-sample gradients", hint="drop --grad-checkpointing")
    if precision_of(spec).grad_scaler:
        raise SpecError(f"--precision {spec.precision} with --dp: GradScaler does not unscale Opacus' per-sample gradients",
                        hint="use --precision amp-bf16 or bf16")
    if spec.grad_sample_mode == "ghost" and task not in GHOST_TASKS:
        raise SpecError(f"--grad-sample-mode ghost needs a per-sample loss, which memlens builds for {', '.join(GHOST_TASKS[:-1])} "
                        f"models and factories (this model trains {task})", hint="use --grad-sample-mode hooks")


# ---------------------------------------------------------------- make_private, the way users call it
def make_private(spec, model, optimizer, batch, *, device, fake: bool, task: str, loss_fn: Callable | None = None,
                 keep_outputs: bool = False,
                 autocast: Callable[[], Any] = contextlib.nullcontext, name: str = "model",
                 grad_sample_mode: str | None = None) -> DPStep:
    """Wrap ``model`` and ``optimizer`` with Opacus' ``PrivacyEngine.make_private`` over a data
    loader of ``batch`` (the logical batch, on the host), and ``BatchMemoryManager`` with the
    spec's physical batch.

    For a distributed step the module is the rank's, already wrapped in Opacus'
    ``DifferentiallyPrivateDistributedDataParallel``, with the rank's own logical batch: Opacus picks
    ``DistributedDPOptimizer`` from the module type."""
    require_opacus()

    import torch  # heavy: torch, loaded on first use
    from opacus import PrivacyEngine  # optional: opacus (memlens[dp])
    from opacus.utils.batch_memory_manager import BatchMemoryManager  # optional: opacus (memlens[dp])
    from opacus.validators.errors import UnsupportedModuleError  # optional: opacus (memlens[dp])
    from torch.utils._pytree import tree_flatten  # heavy: torch, loaded on first use

    first = next((t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor) and t.dim() > 0), None)
    if first is None:
        raise SpecError(f"{name}: the batch has no tensor with a batch dimension", hint="DP-SGD splits the batch per sample")
    n = int(first.shape[0])
    physical = min(spec.physical_batch_size or n, n)
    mode = grad_sample_mode or spec.grad_sample_mode or "hooks"
    if mode == "ghost" and _is_fsdp(model):
        mode = "ghost_fsdp"     # Opacus' FSDP2 ghost clipping (the model went through its FSDP2Wrapper)
    fallback = functorch_layers(model, mode)
    if fake and fallback:
        raise SpecError(f"Opacus has no grad sampler for {', '.join(fallback)}: it would use functorch, which does not run "
                        "on the fake tensors of an estimate", hint="freeze those layers (--freeze), train LoRA adapters "
                        "(--lora-rank 16), or measure it: memlens profile --dp --device cuda")
    gather = Gather(batch, n)
    loader = torch.utils.data.DataLoader(SampleIndices(n), batch_size=n, shuffle=False, collate_fn=gather)
    criterion = None
    if mode.startswith("ghost"):
        criterion = FactoryCriterion(loss_fn, name) if task == "factory" else torch.nn.CrossEntropyLoss()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # "Secure RNG turned off" and friends
        engine = PrivacyEngine()
        kwargs = dict(module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=spec.noise_multiplier,
                      max_grad_norm=spec.max_grad_norm, poisson_sampling=False, grad_sample_mode=mode)
        if criterion is not None:
            kwargs["criterion"] = criterion
        try:
            out = engine.make_private(**kwargs)
        except (UnsupportedModuleError, NotImplementedError, ValueError) as e:
            msg = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise SpecError(f"Opacus cannot make {name} private: {msg}",
                            hint="freeze the unsupported modules (--freeze), or train LoRA adapters (--lora-rank 16)") from None
    if mode.startswith("ghost"):
        dp_model, dp_opt, dp_criterion, dp_loader = out
    else:
        (dp_model, dp_opt, dp_loader), dp_criterion = out, None
    bmm = BatchMemoryManager(data_loader=dp_loader, max_physical_batch_size=physical, optimizer=dp_opt)
    step = DPStep(dp_model, dp_opt, dp_criterion, dp_loader, bmm.__enter__(), engine, gather, device, fake, mode, task,
                  n, physical, loss_fn=loss_fn, autocast=autocast, functorch_layers=fallback, loss_kind=spec.loss,
                  keep_outputs=keep_outputs)
    # the grad / norm samplers run inside the observer's category scope (instance attributes
    # shadow Opacus' class-level registries; the functions are Opacus' own)
    dp_model.GRAD_SAMPLERS = {k: step._scoped(f, PER_SAMPLE) for k, f in type(dp_model).GRAD_SAMPLERS.items()}
    if hasattr(type(dp_model), "NORM_SAMPLERS"):
        dp_model.NORM_SAMPLERS = {k: step._scoped(f, GRAM) for k, f in type(dp_model).NORM_SAMPLERS.items()}
    step.original_optimizer.register_step_pre_hook(lambda opt, args, kwargs: step._on_phase("optimizer"))
    return step


def functorch_layers(model, mode: str) -> list[str]:
    """Types of trainable layers Opacus has no grad (or, for ghost, norm) sampler for: it computes their
    per-sample gradients with functorch (``torch.func.vmap(grad(...))`` over a meta-device copy)."""
    from opacus.grad_sample import (  # optional: opacus (memlens[dp])
        GradSampleModule,
        GradSampleModuleFastGradientClipping,
    )
    from opacus.utils.module_utils import trainable_modules  # optional: opacus (memlens[dp])

    known = set(GradSampleModule.GRAD_SAMPLERS)
    if mode.startswith("ghost"):
        known |= set(GradSampleModuleFastGradientClipping.NORM_SAMPLERS)
    return sorted({_layer_type(m).__name__ for _, m in trainable_modules(model) if _layer_type(m) not in known})


def _is_fsdp(model) -> bool:
    from torch.distributed.fsdp import FSDPModule  # heavy: torch, loaded on first use

    return isinstance(model, FSDPModule)


def _layer_type(m) -> type:
    """A layer's own class: fully_shard makes ``FSDP<Class>(FSDPModule, Class)`` (Opacus reads ``__bases__[1]``)."""
    t = type(m)
    return t.__bases__[1] if _is_fsdp(m) and len(t.__bases__) > 1 else t


def describe(step: DPStep) -> str:
    """One line for the prepared step's "applied" list."""
    what = {"hooks": "per-sample gradients (hooks)", "ghost_fsdp": "ghost clipping under FSDP2 (ghost_fsdp: two backward "
            "passes, each all-gathering and reduce-scattering every FSDP group)"}.get(step.mode, "ghost clipping (two backward passes)")
    text = (f"DP-SGD with Opacus {_version()}: make_private {what}, max_grad_norm {step.optimizer.max_grad_norm:g}, "
            f"noise {step.optimizer.noise_multiplier:g}; BatchMemoryManager: logical batch {step.logical_batch} in "
            f"{step.n_physical} physical batch(es) of <= {step.physical_batch}")
    if step.fake and step.n_physical > 3:
        text += " (simulated: the first two, the last, and each change of size; the others repeat their memory)"
    return text


def _version() -> str:
    import opacus  # optional: opacus (memlens[dp])

    return opacus.__version__


__all__ = ["DPStep", "make_private", "check_spec", "require_opacus", "describe", "GHOST_TASKS"]
