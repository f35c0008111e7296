"""DP-SGD with ghost clipping over FSDP2, for one rank: Opacus' ``ghost_fsdp``
(``--dp --grad-sample-mode ghost --sharding fsdp|zero3 --world-size N``).

What Opacus does (opacus 1.6: utils/fsdp_utils.py, grad_sample/grad_sample_module_fast_gradient_clipping_fsdp.py,
optimizers/fsdpoptimizer_fast_gradient_clipping.py, utils/fast_gradient_clipping_utils.py), all of it
run as is here, on fake tensors under the fake process group for an estimate:

- ``FSDP2Wrapper(model, mp_policy=...)`` calls ``fully_shard`` on every submodule that holds
  parameters of its own and is a layer type Opacus has a grad or norm sampler for (or has no
  trainable parameter: frozen base layers, norms, embeddings), then on the root. So every leaf
  layer is its own FSDP group (not one group per transformer block, as :mod:`.fsdp` wraps):
  one all-gather per layer in forward and again in each backward pass. ``opacus_high_precision_layers``
  (none here) would stay fp32; it takes no ``reshard_after_forward`` (zero2 is refused);
- ``make_private(grad_sample_mode="ghost_fsdp")`` wraps it in ``GradSampleModuleFastGradientClippingFSDP``:
  its forward hooks keep each trainable layer's detached inputs in ``module.activations`` and
  its backward hooks the per-sample norms in ``module.norm_sample``; a module run twice in one
  forward (a tied parameter) is refused by Opacus, and memlens refuses any tied parameter up front;
- ``DPTensorFastGradientClipping.backward``: backward 1 with ``retain_graph=True`` (per-sample
  norms; every saved activation stays alive), ``zero_grad``, the clipping coefficients, then
  backward 2 of the re-weighted loss with the hooks off. FSDP2's pre-backward hooks sit on the
  retained graph, so each pass all-gathers every group's parameters and reduce-scatters its
  gradients: twice per physical batch (counted per pass in ``facts["passes"]``);
- ``FSDPOptimizerFastGradientClipping`` (built over the DTensor parameters after wrapping, as
  Opacus requires): ``summed_grad = clone(p.grad)`` per shard; on the last physical batch
  ``_generate_noise`` with ``reference=p.grad``, a DTensor: ``torch.zeros`` / ``torch.normal`` of its
  *global* shape (a full, unsharded tensor per parameter, one at a time), added under
  ``implicit_replication``.
"""
from __future__ import annotations

import contextlib
import importlib
from collections import Counter

from ...core.errors import SpecError
from ...core.spec import TrainingSpec
from ..optim import make_optimizer
from .fsdp import FSDPWrapper, default_mesh


def tied_parameters(model) -> list[str]:
    """Names of parameters held by more than one module (tied embeddings)."""
    owners: dict[int, list[str]] = {}
    for name, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append(f"{name}.{pname}" if name else pname)
    return sorted(n for names in owners.values() if len(names) > 1 for n in names)


class DPFSDPWrapper(FSDPWrapper):
    """Opacus' FSDP2Wrapper + ghost_fsdp (see the module docstring)."""

    name = "dp_fsdp"
    strategy = "Opacus FSDP2Wrapper (fully_shard per layer + root) + ghost_fsdp (FSDPOptimizerFastGradientClipping)"

    def __init__(self, spec: TrainingSpec, **kw):
        super().__init__(spec, **kw)
        self.applied[-1] = (f"Opacus FSDP2Wrapper over {self.world_size} GPUs: fully_shard per supported layer + root "
                            f"({'MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)' if spec.precision == 'amp-bf16' else 'no MixedPrecisionPolicy'})")
        self.pass_marks: list = []            # DPStep.passes: (run, physical batch, pass, event index)
        self.counts: Counter = Counter()      # (pass, "all-gather" | "reduce-scatter") -> calls, first physical batch

    def shard(self, model, mesh, mp) -> list:
        from opacus.utils.fsdp_utils import FSDP2Wrapper  # optional dependency

        tied = tied_parameters(model)
        if tied:
            raise SpecError(f"ghost_fsdp does not support tied parameters ({', '.join(tied[:2])}): Opacus refuses "
                            "parameter tying with FSDP", hint="use a model with untied embeddings, or --sharding ddp")
        with default_mesh(mesh):      # Opacus calls fully_shard without a mesh: ours, not the accelerator's
            FSDP2Wrapper(model, mp_policy=mp)
        from torch.distributed.fsdp import FSDPModule  # heavy: torch, loaded on first use

        return [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]

    def wrap(self, model, *, device, fake_mode=None):
        model = super().wrap(model, device=device, fake_mode=fake_mode)
        self.facts["fsdp_groups"] = self.facts.pop("blocks", 0) + 1
        self.facts.pop("block_class", None)
        self.facts["wrapped_by"] = "opacus.utils.fsdp_utils.FSDP2Wrapper"
        return model

    def make_optimizer(self, spec: TrainingSpec, model, simulate: bool):
        """The spec's optimizer over the DTensor parameters: make_private checks that the optimizer's
        parameters are the module's, and FSDPOptimizerFastGradientClipping works on the DTensors."""
        return make_optimizer(spec, model, simulate=simulate)

    def inner(self, model):
        return getattr(model, "_module", model)

    @contextlib.contextmanager
    def simulation(self, tracker, step):
        """FSDP2's simulation (see :class:`.fsdp.FSDPWrapper`), plus a count of all-gathers
        (``unshard``) and reduce-scatters (``post_backward``) in forward and in each backward pass
        of the first physical batch of step 1: FSDP2's own ``foreach_all_gather`` / ``foreach_reduce``
        calls (an unshard of a group already gathered does not all-gather; a group without
        gradients, frozen layers, does not reduce-scatter)."""
        dp = getattr(step, "dp", None)
        pg = importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_param_group")
        with super().simulation(tracker, step):
            saved = {m: getattr(pg, m) for m in ("foreach_all_gather", "foreach_reduce")}

            def counted(fn, what):
                def run(*a, **k):
                    if dp is not None and dp.runs == 1 and dp.physical[0] == 1:
                        self.counts[(dp.current_pass, what)] += 1
                    return fn(*a, **k)
                return run

            pg.foreach_all_gather = counted(saved["foreach_all_gather"], "all-gather")
            pg.foreach_reduce = counted(saved["foreach_reduce"], "reduce-scatter")
            try:
                yield
            finally:
                for m, fn in saved.items():
                    setattr(pg, m, fn)
                self.facts["passes"] = self.passes()
                self.pass_marks = list(dp.passes) if dp is not None else []

    def passes(self) -> list[dict]:
        """Collectives per pass of the first physical batch (FSDP2 group calls)."""
        out = []
        for name in ("forward", "backward 1", "backward 2"):
            out.append({"pass": name, "all_gathers": self.counts.get((name, "all-gather"), 0),
                        "reduce_scatters": self.counts.get((name, "reduce-scatter"), 0)})
        return out


__all__ = ["DPFSDPWrapper", "tied_parameters"]
