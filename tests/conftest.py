import os

import pytest
import torch

# The chapters and tests must not depend on the caller's profile choice.
os.environ.pop("QKOV_PROFILE", None)

#: Torch threads of every test (and of the kernels and workers the tests start). CI runs the suite
#: with 1 and with 2, so a result that depends on summation order across threads shows up there.
TEST_THREADS = int(os.environ.get("QKOV_TEST_THREADS", "1"))
os.environ["OMP_NUM_THREADS"] = str(TEST_THREADS)


@pytest.fixture(autouse=True)
def _deterministic_threads():
    torch.set_num_threads(TEST_THREADS)
    yield


def pytest_report_header(config):
    return f"torch threads per test: {TEST_THREADS} (QKOV_TEST_THREADS)"


@pytest.fixture
def flush_supported():
    """Skip where the CPU cannot flush subnormal floats; else start the test in the default mode (kept)."""
    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU cannot flush subnormal floats")
