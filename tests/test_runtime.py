"""qkov_lib.runtime.is_batched: torch.func.vmap's batched tensors are told from plain ones, and a
torch without the private check answers None instead of failing. qkov_lib.runtime.flush_denormals:
subnormal results become 0 inside the block, and the previous mode comes back after it."""

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


TINY = torch.finfo(torch.float32).tiny  # float32's smallest normal number


def _quarter_tiny() -> float:
    """TINY / 4 as this thread's CPU computes it: a subnormal float32, or 0 when flushed."""
    return float(torch.full((), TINY).mul(0.25))


def test_flush_denormals_zeroes_subnormal_results_and_restores_the_mode(flush_supported):
    assert _quarter_tiny() == pytest.approx(TINY / 4, rel=1e-6) and not runtime.flushing_denormals()
    with runtime.flush_denormals():
        assert _quarter_tiny() == 0.0 and runtime.flushing_denormals()
        assert float(torch.full((), TINY).mul(4.0)) == pytest.approx(4 * TINY, rel=1e-6)  # normal numbers unchanged
        with runtime.flush_denormals(False):  # nested: kept inside, flushed again after
            assert _quarter_tiny() > 0
        assert _quarter_tiny() == 0.0
    assert _quarter_tiny() > 0 and not runtime.flushing_denormals()


def test_flush_denormals_restores_the_mode_after_an_error_and_refuses_a_non_bool(flush_supported):
    with pytest.raises(RuntimeError, match="inside"):
        with runtime.flush_denormals():
            raise RuntimeError("inside")
    assert not runtime.flushing_denormals()
    for bad in (1, "yes", None):
        with pytest.raises(ValueError, match="True or False"):
            with runtime.flush_denormals(bad):
                pass
    assert not runtime.flushing_denormals()
