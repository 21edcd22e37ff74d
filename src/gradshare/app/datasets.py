"""Small real datasets that work offline, for the demo, the tests and the benchmarks.

``digits`` is scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes);
scikit-learn is in the ``demo`` and ``dev`` extras.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "DIGITS_CLASSES",
    "DIGITS_FEATURES",
    "DIGITS_SAMPLES",
    "Split",
    "digits",
    "digits_train_size",
    "minibatches",
    "mlp",
]

DIGITS_SAMPLES = 1797
"""Images in scikit-learn's digits: the sizes are known before it is loaded (to check options)."""
DIGITS_FEATURES = 64
"""Features of a digits image (8x8 pixels)."""
DIGITS_CLASSES = 10
"""Its classes, the digits 0 to 9."""


@dataclass(frozen=True, slots=True)
class Split:
    """Train and test tensors of a classification dataset."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    @property
    def num_features(self) -> int:
        return self.x_train.shape[1]

    @property
    def num_classes(self) -> int:
        return int(max(self.y_train.max(), self.y_test.max())) + 1


def digits(test_fraction: float = 0.25, seed: int = 0) -> Split:
    """scikit-learn's digits as float32 features in [0, 1] and int64 labels, split at random."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError(
            "The digits dataset needs scikit-learn: pip install 'gradshare[demo]'."
        ) from e
    if not 0 < test_fraction < 1:
        raise ValueError(f"Expect `test_fraction` in (0, 1), got {test_fraction}.")
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = round(len(y) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return Split(x[train], y[train], x[test], y[test])


def digits_train_size(test_fraction: float = 0.25) -> int:
    """Training images of :func:`digits` with ``test_fraction``, without loading it."""
    return DIGITS_SAMPLES - round(DIGITS_SAMPLES * test_fraction)


def minibatches(
    x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(x, y)`` cut into minibatches, shuffled with ``seed`` (None keeps the order)."""
    if batch_size < 1:
        raise ValueError(f"Expect `batch_size` >= 1, got {batch_size}.")
    order = (
        torch.arange(len(y))
        if seed is None
        else torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    )
    return [
        (x[order[i : i + batch_size]], y[order[i : i + batch_size]])
        for i in range(0, len(y), batch_size)
    ]


def mlp(num_features: int, num_classes: int, hidden: int = 64, seed: int = 0) -> nn.Module:
    """A two-layer ReLU MLP, initialised from ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Linear(num_features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )
