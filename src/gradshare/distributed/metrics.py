"""What every sharing mode reports, under one naming, and the warnings for settings that lose.

:func:`share_metrics` gives ``bytes_sent``, ``dense_bytes``, ``compression`` (dense bytes /
sent bytes), ``density`` (the kept fraction of the last step), ``threshold`` (its t; the
mean over parameters where each has its own) and ``stalled`` (the tensors that have sent
nothing for :data:`STALLED_AFTER` exchanges in a row while they held a residual:
:class:`Unsent`). ``SharedOptimizer.metrics()``,
``ThresholdHookState.metrics()`` and ``LocalSteps.metrics()`` return it; the integrations put
it in Lightning's ``self.log`` and Trainer's logs.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

import torch

from gradshare.encoding.encoder import EncodeStats

__all__ = [
    "ADAPTIVE_OPTIMIZERS",
    "STALLED_AFTER",
    "Unsent",
    "is_adaptive",
    "share_metrics",
    "warn_if_adaptive",
    "warn_once",
]

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
        logging.getLogger(__name__),
        "hook-adaptive",
        f"{where} shares gradients (the hook) into {name}, which rescales every element by "
        "its own history: the elements the threshold holds back arrive late and in bursts, "
        f"and {name} turns them into full-size steps. Share the updates instead "
        "(SharedOptimizer: share='updates'), which trains better with adaptive optimizers "
        "(docs/guide.md).",
    )
    return True


STALLED_AFTER = 100
"""Exchanges in a row after which a tensor that held a residual and sent nothing is reported
(:class:`Unsent`)."""


class Unsent:
    """Per tensor: the exchanges in a row in which it sent nothing while its residual held
    something. A tensor that reaches :data:`STALLED_AFTER` is named in a warning (once per
    process) and counted in ``stalled`` of :func:`share_metrics`: its threshold is too high
    for it, and its update waits in the residual."""

    __slots__ = ("counts", "what")

    def __init__(self, what: str) -> None:
        self.what = what
        """Who counts, for the warning (``"LocalSteps"``, ``"the DDP hook"``)."""
        self.counts: dict[object, int] = {}

    def count(self, name: object, stats: EncodeStats | None) -> None:
        """Count one exchange of tensor ``name`` by its encode ``stats``."""
        held = stats is not None and stats.entries == 0 and stats.residual_norm > 0
        n = self.counts[name] = self.counts.get(name, 0) + 1 if held else 0
        if n == STALLED_AFTER:
            assert stats is not None
            text = (
                f"{self.what}: parameter {name} has sent nothing for {n} exchanges in a row "
                f"while its residual holds an update (L2 norm {stats.residual_norm:.3g}, "
                f"threshold {stats.threshold:.3g}): its update waits. Use QuantileThreshold "
                "(it sends every tensor's largest entries) or a lower threshold."
            )
            warn_once(logging.getLogger(__name__), f"stalled {self.what} {name}", text)

    def stalled(self) -> int:
        """How many tensors have sent nothing for :data:`STALLED_AFTER` exchanges or more."""
        return sum(1 for n in self.counts.values() if n >= STALLED_AFTER)


def share_metrics(
    bytes_sent: int,
    dense_bytes: int,
    stats: Iterable[EncodeStats | None] = (),
    *,
    encoded: bool = False,
    stalled: int = 0,
) -> dict[str, float]:
    """The metrics of a sharing mode: its byte counters, its last step's encode stats and
    the count of ``stalled`` tensors (:class:`Unsent`).

    Without stats: density 1 and threshold 0 when the mode sends dense (``encoded=False``);
    NaN for both when it encodes but has not encoded since it started or loaded a state
    (the stats of the step before a resume are not saved): not known yet, not dense. The
    threshold is the mean over the tensors sent by threshold (not those sent whole)."""
    last = [s for s in stats if s is not None]
    numel = sum(s.dense_bytes for s in last) // 4
    density = sum(s.entries for s in last) / numel if numel else (math.nan if encoded else 1.0)
    ts = [s.threshold for s in last if s.format != "dense"]
    threshold = sum(ts) / len(ts) if ts else (math.nan if encoded and not last else 0.0)
    return {
        "bytes_sent": float(bytes_sent),
        "dense_bytes": float(dense_bytes),
        "compression": dense_bytes / bytes_sent if bytes_sent else float("inf"),
        "density": density,
        "threshold": threshold,
        "stalled": float(stalled),
    }
