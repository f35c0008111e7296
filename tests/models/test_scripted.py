"""TorchScript helpers of model code run as their Python originals in a simulation (DeBERTa-v2/v3 on
transformers 5.15-5.23 scripts its relative-position helpers; the Makefile's lowest-versions run covers it)."""
import importlib
import sys
from pathlib import Path

import torch

from memlens.core.spec import TrainingSpec
from memlens.estimator import estimate
from memlens.models.scripted import python_originals

CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "configs"


def _module_with_a_scripted_helper(tmp_path):
    (tmp_path / "memlens_test_scripted_mod.py").write_text(
        "import torch\n\n\n@torch.jit.script\ndef twice(x):\n    return x * 2\n\n\n"
        "class Net(torch.nn.Module):\n    def forward(self, x):\n        return twice(x)\n")
    sys.path.insert(0, str(tmp_path))
    try:
        return importlib.import_module("memlens_test_scripted_mod")
    finally:
        sys.path.remove(str(tmp_path))


def test_script_functions_are_swapped_for_their_python_and_restored(tmp_path):
    mod = _module_with_a_scripted_helper(tmp_path)
    try:
        scripted = mod.twice
        assert isinstance(scripted, torch.jit.ScriptFunction)
        with python_originals(mod.Net()) as n:
            assert n == 1 and not isinstance(mod.twice, torch.jit.ScriptFunction)
            from torch._subclasses.fake_tensor import FakeTensorMode

            with FakeTensorMode():   # the interpreter would refuse a fake tensor; the Python body runs
                assert mod.Net()(torch.empty(3)).shape == (3,)
        assert mod.twice is scripted
    finally:
        del sys.modules[mod.__name__]


def test_deberta_v2_estimates_on_every_transformers_version():
    """transformers up to 5.23 scripts DeBERTa-v2's helpers (the estimate stopped on "runs TorchScript functions");
    the same step on 5.24 runs them as Python: both estimate, and the swap leaves the module as it was."""
    import transformers.models.deberta_v2.modeling_deberta_v2 as deberta

    before = dict(vars(deberta))
    r = estimate(TrainingSpec(model=str(CONFIGS / "deberta-v2.json"), batch_size=2, seq_len=32))
    assert r.peak_allocated_bytes > 0
    assert all(vars(deberta)[k] is v for k, v in before.items())
