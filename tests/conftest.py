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


EPS32 = torch.finfo(torch.float32).eps


def f32_close(got: torch.Tensor, want: torch.Tensor, depth: int) -> bool:
    """Equal up to float32 accumulation order: a sum of ``depth`` terms taken in another order
    (another CPU's kernels, blocking or vector width) differs by at most depth·eps relative to
    its summed magnitude (Higham's γ_n bound), taken norm-wise over the tensor."""
    return float((got - want).norm()) <= depth * EPS32 * float(want.norm())


def assert_f32_close(got: torch.Tensor, want: torch.Tensor, depth: int) -> None:
    """:func:`f32_close` as an assertion that reports the relative error against the bound."""
    err = float((got - want).norm()) / max(float(want.norm()), 1e-30)
    assert f32_close(got, want, depth), f"relative error {err:.3g} > {depth} * eps"
