import os

import pytest
import torch

# The chapters and tests must not depend on the caller's profile choice.
os.environ.pop("QKOV_PROFILE", None)


@pytest.fixture(autouse=True)
def _deterministic_threads():
    torch.set_num_threads(1)
    yield
