"""The build on a CUDA device returns the segments it left free (memlens.models.build._release_build_cache):
a tied model's from_config makes its output weight before tying it, a transient a user's from_pretrained
does not have (bench/results/reserved_check.md)."""
import torch

from memlens.models import build


def test_released_on_cuda_only(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    build._release_build_cache("cpu")
    build._release_build_cache(None)
    assert calls == []
    build._release_build_cache("cuda")
    build._release_build_cache(torch.device("cuda", 0))
    assert calls == [1, 1]


def test_no_cuda_no_call(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: (_ for _ in ()).throw(AssertionError("called")))
    build._release_build_cache("cuda")
