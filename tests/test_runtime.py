"""qkov_lib.runtime.is_batched: torch.func.vmap's batched tensors are told from plain ones, and a
torch without the private check answers None instead of failing."""

import pytest
import torch

from qkov_lib import runtime
from qkov_lib.runtime import is_batched


@pytest.fixture(autouse=True)
def _fresh_check():
    runtime._batched_check.cache_clear()
    yield
    runtime._batched_check.cache_clear()


def _inside_vmap(levels: int = 1) -> list:
    """is_batched of the argument and of a fresh tensor, seen inside ``levels`` nested vmaps."""
    seen = []
    f = lambda t: seen.append((is_batched(t), is_batched(torch.ones(2)))) or t  # noqa: E731
    for _ in range(levels):
        f = torch.func.vmap(f)
    f(torch.zeros(*[3] * levels, 2))
    return seen


def test_plain_and_vmapped_tensors():
    assert is_batched(torch.zeros(3)) is False
    assert _inside_vmap() == [(True, False)]  # decided inside vmap on first use
    assert _inside_vmap(2) == [(True, False)]
    assert is_batched(torch.zeros(3, requires_grad=True)) is False
    with pytest.raises(TypeError, match="expected a tensor"):
        is_batched([1.0])


def _raises_type_error(x):
    raise TypeError("is_batchedtensor(): incompatible function arguments")


@pytest.mark.parametrize("broken", ["missing", "TypeError", "always False"])
def test_unknown_when_the_private_check_is_missing_or_changed(broken, monkeypatch):
    functorch = torch._C._functorch
    if broken == "missing":
        monkeypatch.delattr(functorch, "is_batchedtensor")
    else:
        monkeypatch.setattr(functorch, "is_batchedtensor", _raises_type_error if broken == "TypeError" else (lambda x: False))
    assert is_batched(torch.zeros(3)) is None
    assert _inside_vmap() == [(None, None)]
    assert runtime._batched_check.cache_info().misses == 1  # probed once
