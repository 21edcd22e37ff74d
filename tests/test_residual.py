"""Residual post-processors (docs/design.md §3): clipping values, schedule, mass, validation."""

from __future__ import annotations

import pytest
import torch

from gradshare import NoResidualProcessing, ResidualClipping


class TestClipping:
    """ResidualClipping clips to ±multiple·t on its schedule and reports the L1 mass dropped."""

    def test_exact_values(self) -> None:
        r = torch.tensor([10.0, -10.0, 1.0, -1.0])
        assert ResidualClipping(5, 5).process_(5, 0, 1.0, r) == 10.0
        assert r.tolist() == [5.0, -5.0, 1.0, -1.0]

    @pytest.mark.parametrize("iteration", [0, 3, 7])
    def test_off_schedule_untouched(self, iteration: int) -> None:
        r = torch.tensor([10.0, -10.0])
        assert ResidualClipping(5, 5).process_(iteration, 0, 1.0, r) == 0.0
        assert r.tolist() == [10.0, -10.0]

    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
    def test_dtypes(self, dtype: torch.dtype) -> None:
        r = torch.tensor([4.0, -3.0, 0.5], dtype=dtype)
        assert ResidualClipping(2, 1).process_(1, 0, 1.0, r) == 3.0
        assert r.tolist() == [2.0, -2.0, 0.5] and r.dtype == dtype

    @pytest.mark.parametrize(
        "kwargs", [{"threshold_multiple": 0.5}, {"frequency": 0}, {"frequency": 1.5}]
    )
    def test_validation(self, kwargs: dict[str, float]) -> None:
        with pytest.raises(ValueError):
            ResidualClipping(**kwargs)  # type: ignore[arg-type]

    def test_state_checks_settings(self) -> None:
        ResidualClipping(3, 2).load_state_dict(ResidualClipping(3, 2).state_dict())
        with pytest.raises(ValueError, match="differs"):
            ResidualClipping(3, 2).load_state_dict(ResidualClipping(5, 5).state_dict())


def test_no_processing() -> None:
    r = torch.tensor([100.0])
    assert NoResidualProcessing().process_(5, 0, 1.0, r) == 0.0
    assert r.tolist() == [100.0]
