"""Shared fixtures. The workflow-copy machinery is dflash.runtime.harness (benchmarks use it too)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash.runtime.harness import REPO


@pytest.fixture(scope="session")
def micro_spec() -> Path:
    return REPO / "tests" / "specs" / "micro.yaml"


@pytest.fixture
def one_torch_thread():
    """One intra-op thread for the test (tiny tensors; robust to a busy machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
