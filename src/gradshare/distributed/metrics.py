"""What every sharing mode reports, under one naming, and the warnings for settings that lose.

:func:`share_metrics` gives ``bytes_sent``, ``dense_bytes``, ``compression`` (dense bytes /
sent bytes), ``density`` (the kept fraction of the last step) and ``threshold`` (its t; the
mean over parameters where each has its own). ``SharedOptimizer.metrics()``,
``ThresholdHookState.metrics()`` and ``LocalSteps.metrics()`` return it; the integrations put
it in Lightning's ``self.log`` and Trainer's logs.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

import torch

from gradshare.encoding.encoder import EncodeStats

__all__ = ["ADAPTIVE_OPTIMIZERS", "is_adaptive", "share_metrics", "warn_if_adaptive", "warn_once"]

ADAPTIVE_OPTIMIZERS = ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "RMSprop")
"""Optimizers that rescale each element: sharing their gradients (the hook) loses to sharing
their updates (``SharedOptimizer``; docs/guide.md)."""

_warned: set[str] = set()


def warn_once(logger: logging.Logger, key: str, message: str) -> None:
    """Log ``message`` as a warning the first time ``key`` is seen in this process."""
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


def _unwrapped(optimizer: object) -> object:
    """The optimizer inside accelerate's (``.optimizer``) or Lightning's (``._optimizer``)
    wrappers, or ``optimizer`` itself."""
    for _ in range(8):
        wrapped = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if not isinstance(wrapped, torch.optim.Optimizer):
            break
        optimizer = wrapped
    return optimizer


def is_adaptive(optimizer: object) -> bool:
    """Whether ``optimizer`` rescales each element: a class of :data:`ADAPTIVE_OPTIMIZERS` or a
    subclass, or any class named "...Adam..." (``FusedAdam``, ``AdamW8bit``). Wrappers that
    hold the optimizer (accelerate's ``.optimizer``, Lightning's ``._optimizer``) are looked
    through."""
    names = [cls.__name__ for cls in type(_unwrapped(optimizer)).__mro__]
    return any(n in ADAPTIVE_OPTIMIZERS or "adam" in n.lower() for n in names)


def warn_if_adaptive(optimizer: object, where: str) -> bool:
    """Warn once when the hook (gradients shared) runs with an adaptive optimizer
    (:func:`is_adaptive`: subclasses and wrapped ones too), where sharing updates trains
    better. Returns whether ``optimizer`` is one."""
    if not is_adaptive(optimizer):
        return False
    name = type(_unwrapped(optimizer)).__name__
    warn_once(
        logging.getLogger(__name__), "hook-adaptive",
        f"{where} shares gradients (the hook) into {name}, which rescales every element by "
        "its own history: the elements the threshold holds back arrive late and in bursts, "
        f"and {name} turns them into full-size steps. Share the updates instead "
        "(SharedOptimizer: share='updates'), which trains better with adaptive optimizers "
        "(docs/guide.md).",
    )  # fmt: skip
    return True


def share_metrics(
    bytes_sent: int, dense_bytes: int, stats: Iterable[EncodeStats | None] = (), *,
    encoded: bool = False,
) -> dict[str, float]:  # fmt: skip
    """The metrics of a sharing mode: its byte counters and its last step's encode stats.

    Without stats: density 1 and threshold 0 when the mode sends dense (``encoded=False``);
    NaN for both when it encodes but has not encoded since it started or loaded a state
    (the stats of the step before a resume are not saved): not known yet, not dense."""
    last = [s for s in stats if s is not None]
    numel = sum(s.dense_bytes for s in last) // 4
    density = sum(s.entries for s in last) / numel if numel else (math.nan if encoded else 1.0)
    threshold = (
        sum(s.threshold for s in last) / len(last) if last else (math.nan if encoded else 0.0)
    )
    return {
        "bytes_sent": float(bytes_sent),
        "dense_bytes": float(dense_bytes),
        "compression": dense_bytes / bytes_sent if bytes_sent else float("inf"),
        "density": density,
        "threshold": threshold,
    }
