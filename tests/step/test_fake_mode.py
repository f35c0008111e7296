"""The simulation's fake mode: its dispatch-cache key tells apart exactly the arguments torch's own key tells apart,
and what an op returns through the cache is what torch's mode returns."""
from __future__ import annotations

import itertools

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, _CacheKeyState

from memlens.step.fake_mode import SimulationFakeMode, simulation_fake_mode

aten = torch.ops.aten


def _tensors(mode):
    """Fake tensors that differ from the first in one metadata field each, and one alike to it."""
    with mode:
        base = torch.empty(4, 6)
        return {
            "base": base,
            "alike": torch.empty(4, 6),
            "dtype": torch.empty(4, 6, dtype=torch.bfloat16),
            "shape": torch.empty(6, 4),
            "stride": torch.empty(6, 4).t(),
            "offset": torch.empty(5, 6)[1:],
            "storage": torch.empty(8, 6)[:4],
            "grad": torch.empty(4, 6, requires_grad=True),
            "conj": torch.empty(4, 6, dtype=torch.complex64).conj(),
            "complex": torch.empty(4, 6, dtype=torch.complex64),
        }


def _key(mode, func, args):
    return mode._cache_key(_CacheKeyState(mode.shape_env), func, args, {})


def test_this_torch_gets_the_fast_key():
    assert type(simulation_fake_mode()) is SimulationFakeMode


def test_the_key_tells_apart_what_torchs_key_tells_apart():
    ours, theirs = SimulationFakeMode(), FakeTensorMode()
    a, b = _tensors(ours), _tensors(theirs)
    pairs = list(itertools.product(a, repeat=2))

    def partition(mode, t):     # which argument pairs share a key: the same grouping in both modes
        groups: dict = {}
        for x, y in pairs:
            groups.setdefault(_key(mode, aten.add.Tensor, (t[x], t[y])), set()).add((x, y))
        return sorted(sorted(g) for g in groups.values())

    ours_groups = partition(ours, a)
    assert ours_groups == partition(theirs, b)
    assert len(ours_groups) == (len(a) - 1) ** 2           # "alike" shares every key of "base", no other pair does
    for name in a:    # one field apart: a key of its own; alike: the same key
        same = _key(ours, aten.neg.default, (a[name],)) == _key(ours, aten.neg.default, (a["base"],))
        assert same == (name in ("base", "alike")), name


def test_plain_values_are_keyed_with_their_type():
    mode = SimulationFakeMode()
    t = _tensors(mode)["base"]
    keys = {_key(mode, aten.mul.Scalar, (t, v)) for v in (1, 1.0, True, 2)}
    assert len(keys) == 4         # 1, 1.0 and True hash alike but give other dtypes


def test_outputs_through_the_cache_are_torchs():
    ours, theirs = SimulationFakeMode(), FakeTensorMode()
    outs = []
    for mode in (ours, theirs):
        with mode:
            x = torch.empty(3, 8, 5).transpose(0, 1)
            w = torch.empty(5, 7, dtype=torch.float32)
            got = []
            for _ in range(2):             # the second call of each op is a cache hit
                got += [x @ w, x.sum(-1), torch.cat([x, x], 1), x.contiguous(), x[1:], x.view(8, 15) if x.is_contiguous()
                        else x.reshape(8, 15)]
            outs.append([(o.shape, o.stride(), o.dtype, o.storage_offset(), o.untyped_storage().nbytes()) for o in got])
    assert outs[0] == outs[1]
    assert outs[0][:6] == outs[0][6:]
