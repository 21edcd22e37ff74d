"""Residual post-processors: what happens to the residual after each message (docs/design.md §3).

Clipping is the one place where gradshare deliberately drops update mass; every processor
returns how much (L1) it dropped, so that the conservation law can still be checked.
"""

from __future__ import annotations

import abc
import math
from typing import Any

import torch

from gradshare._checks import check_int

__all__ = ["NoResidualProcessing", "ResidualClipping", "ResidualPostProcessor"]


class ResidualPostProcessor(abc.ABC):
    """Change a worker's residual in place after a message; return the L1 mass removed."""

    @abc.abstractmethod
    def process_(
        self, iteration: int, epoch: int, threshold: float, residual: torch.Tensor
    ) -> float:
        """Post-process ``residual`` in place for step ``iteration`` at threshold ``threshold``."""

    def settings(self) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {"class": type(self).__name__, "settings": self.settings()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Check the saved processor matches this one (processors hold no other state)."""
        if state.get("class") != type(self).__name__ or state.get("settings") != self.settings():
            raise ValueError(
                f"Saved post-processor {state.get('class')}{state.get('settings')} differs from "
                f"{self!r}: build the same post-processor before loading."
            )

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.settings().items())
        return f"{type(self).__name__}({args})"


class NoResidualProcessing(ResidualPostProcessor):
    """Leave the residual alone (DL4J's ParallelWrapper default)."""

    def process_(
        self, iteration: int, epoch: int, threshold: float, residual: torch.Tensor
    ) -> float:
        return 0.0


class ResidualClipping(ResidualPostProcessor):
    """Every ``frequency`` steps, clip the residual to ``±threshold_multiple · t``.

    DL4J's Spark trainer uses (5, 5). Clipping bounds how far a worker can fall behind (a
    residual far above t means updates arrive faster than the threshold lets them out) at the
    cost of dropping that excess: the returned L1 mass. Raise ``threshold_multiple`` to drop
    less, lower ``frequency`` to bound the residual more tightly.

    Args:
        threshold_multiple: the clip bound in units of t, >= 1.
        frequency: clip when ``iteration > 0`` and ``iteration % frequency == 0``; >= 1.
    """

    def __init__(self, threshold_multiple: float = 5.0, frequency: int = 5) -> None:
        multiple = float(threshold_multiple)
        if not (math.isfinite(multiple) and multiple >= 1):
            raise ValueError(
                f"Expect `threshold_multiple` finite and >= 1, got {threshold_multiple!r}: "
                "under 1 the clip would cut what a message is about to send."
            )
        check_int(
            frequency,
            "frequency",
            why=": it is the number of steps between clips (DL4J divides by zero on 0)",
        )
        self.threshold_multiple = multiple
        self.frequency = frequency

    def settings(self) -> dict[str, Any]:
        return {"threshold_multiple": self.threshold_multiple, "frequency": self.frequency}

    def process_(
        self, iteration: int, epoch: int, threshold: float, residual: torch.Tensor
    ) -> float:
        if iteration <= 0 or iteration % self.frequency:
            return 0.0
        bound = self.threshold_multiple * float(threshold)
        excess = (residual.abs() - bound).clamp_(min=0)
        mass = float(excess.sum(dtype=torch.float64))
        if mass:
            residual.clamp_(-bound, bound)
        return mass
