"""DP-SGD (Opacus, hooks and ghost clipping) writes a deep stack's layers from 3- and 4-layer models
(memlens.estimator.depth): the log of the whole model simulated, event for event, and so its estimate
to the byte, at several physical batches of one logical batch (the family is checked once)."""
import pytest

from memlens.core.events import canonical
from memlens.core.spec import TrainingSpec
from memlens.estimator import depth
from memlens.estimator.simulate import _simulate, simulate
from memlens.models.source import resolve
from memlens.step.plan import resolve as plan_of
from tests.estimator.test_depth import LLAMA, deep

pytest.importorskip("opacus")


@pytest.mark.parametrize("changes, written", [
    ({"grad_sample_mode": "hooks", "precision": "bf16"}, True),
    ({"grad_sample_mode": "ghost", "precision": "bf16"}, True),    # per-sample norms stacked over every layer in backward
    # autocast under Opacus: the check on 3 and 4 layers fails, so the whole model is simulated (the same answer)
    ({"grad_sample_mode": "hooks", "precision": "amp-bf16", "loss": "criterion-fp32"}, False),
], ids=["hooks-bf16", "ghost-bf16", "hooks-amp-criterion"])
@pytest.mark.slow
def test_dp_layers_written_equal_the_whole_model(tmp_path, monkeypatch, changes, written):
    # 6 layers (depth writes from 10 on; lowered here): layers 5 and 6 written from 3 and 4, as 5..12 are for 12, and
    # the whole model's reference simulation half as long
    monkeypatch.setattr(depth, "MIN_LAYERS", 6)
    model = deep(tmp_path, LLAMA, 6)
    src = resolve(model)
    depth.CHECKED.clear()
    # 3 of 8: a smaller last physical batch; 8: one; 2: the family checked already. A family whose check failed is
    # simulated whole at every size: its first two sizes say so (the check, then the failure remembered)
    for i, physical in enumerate((3, 8, 2) if written else (3, 8)):
        spec = TrainingSpec(model=model, batch_size=8, physical_batch_size=physical, seq_len=32, dp=True, lora_rank=4, **changes)
        assert depth.why_not(plan_of(spec, source=src), src) is None
        fast = simulate(spec, src)
        whole = _simulate(spec, src, 2, True)
        # after the family's check, the 4-layer simulation alone (the norms stacked over every layer sized from its own list)
        expected = ("written from 4 layers (the rule checked" if i else "written from 3 and 4 layers") if written else "simulated ("
        assert fast.later_layers.startswith(expected), fast.later_layers
        assert canonical(fast.log) == canonical(whole.log)
        assert (fast.param_count, fast.trainable_count) == (whole.param_count, whole.trainable_count)
