"""Small deterministic data and models shared by the training tests, a log catcher, and a hostile
pickle."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradshare.app.datasets import mlp


def toy_batches(
    count: int, batch: int = 8, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` minibatches of 10 features and 3 classes, the same for every caller."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, 10, generator=g), torch.randint(0, 3, (batch,), generator=g))
        for _ in range(count)
    ]


def toy_model(seed: int = 0) -> nn.Module:
    return mlp(10, 3, hidden=16, seed=seed)


def flat(model: nn.Module) -> torch.Tensor:
    """Every parameter, flattened and concatenated."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@contextlib.contextmanager
def logged(name: str = "gradshare") -> Iterator[list[tuple[str, str]]]:
    """The (level name, message) of every record of logger ``name`` and its children within,
    DEBUG included; the logger's level is restored after."""
    said: list[tuple[str, str]] = []
    handler = logging.Handler(logging.DEBUG)

    def emit(record: logging.LogRecord) -> None:
        said.append((record.levelname, record.getMessage()))

    handler.emit = emit  # type: ignore[method-assign]
    logger = logging.getLogger(name)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield said
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


class Hostile:
    """Unpickling it creates the file ``path``: a stand-in for the code a tampered file runs.

    ``torch.load(..., weights_only=True)`` refuses it (``pickle.UnpicklingError``).
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))
