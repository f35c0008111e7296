"""The factory rule: a dict batch reaches forward only through the entries forward takes."""
import pytest

from memlens.core.errors import ModelSourceError
from memlens.core.spec import TrainingSpec
from memlens.estimator import estimate

W = 1024 * 1024 * 4


def test_labels_stay_out_of_forward_and_reach_the_loss():
    r = estimate(TrainingSpec(model="tests.tiny_models:labelled", optimizer="sgd"))
    # the batch: x (16 x 1024 fp32) and y (16 int64, one 512-byte block)
    assert r.by_category["inputs"] == 16 * 1024 * 4 + 512
    assert r.by_category["gradients"] == W


def test_extra_entries_without_a_loss_function_are_refused():
    with pytest.raises(ModelSourceError, match=r"batch entries y are not arguments of forward"):
        estimate(TrainingSpec(model="tests.tiny_models:labelled_no_loss"))


def test_a_batch_forward_takes_nothing_of_is_refused():
    with pytest.raises(ModelSourceError, match=r"forward\(x\) takes none of the batch entries images"):
        estimate(TrainingSpec(model="tests.tiny_models:unmatched"))


def test_a_factory_may_return_its_own_step():
    own = estimate(TrainingSpec(model="tests.tiny_models:own_step", optimizer="sgd"))
    via_loss = estimate(TrainingSpec(model="tests.tiny_models:labelled", optimizer="sgd"))
    assert own.peak_allocated_bytes == via_loss.peak_allocated_bytes
    assert own.by_category["inputs"] == via_loss.by_category["inputs"]


def test_factory_without_spec_cannot_checkpoint():
    from memlens.core.errors import SpecError

    with pytest.raises(SpecError, match="takes no spec, so it cannot apply checkpointing"):
        estimate(TrainingSpec(model="tests.tiny_models:no_spec", grad_checkpointing=True))
