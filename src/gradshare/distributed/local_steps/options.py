"""LocalSteps' options, declared once: :class:`LocalStepsOptions`, its defaults, and the rule
for the default outer learning rate.

:class:`~gradshare.LocalSteps`, the Lightning strategy, the Hugging Face callback and
``gradshare train`` take these fields (by name, or whole as ``local=``) and validate them here
only; a test keeps their keywords the same.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gradshare.distributed.metrics import is_adaptive
from gradshare.encoding.threshold import BITMAP_DENSITY

__all__ = [
    "DEFAULT_DECAY",
    "DEFAULT_DENSITY",
    "DEFAULT_OUTER_LR",
    "DEFAULT_OUTER_LR_SGD",
    "DEFAULT_SYNC_EVERY",
    "FIELDS",
    "LocalStepsOptions",
    "OuterFactory",
    "default_outer_lr",
    "local_steps_options",
]

DEFAULT_SYNC_EVERY = 10
"""H, the inner steps between two syncs, by default."""
DEFAULT_DENSITY = 0.04
"""The fraction of each parameter's elements a sync sends by default (QuantileThreshold)."""
DEFAULT_DECAY = 0.95
"""β, the residual decay of every sync by default (SparseLoCo's error-feedback decay)."""
DEFAULT_OUTER_LR = 2.8
"""The learning rate of the default outer optimizer, plain SGD without momentum, when the inner
optimizer is adaptive (Adam and its kin, :func:`default_outer_lr`). Each sent entry carries
only ±threshold, so a sync moves the global copy less than Δ, and an outer lr above 1 makes up
for it; measured in docs/benchmarks.md ("Local steps": the GPT with AdamW at 2 and 4 ranks).
It does not grow with the world size: a higher lr helped one GPT at 4 and 8 ranks and hurt
another at every size ("More ranks, and a schedule")."""
DEFAULT_OUTER_LR_SGD = 1.4
"""The default outer learning rate for any other inner optimizer (SGD, momentum SGD): the lr
that kept the CNN with momentum SGD nearest dense DDP (docs/benchmarks.md)."""

OuterFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
"""Builds the outer optimizer from the global copy's tensors."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalStepsOptions:
    """How :class:`~gradshare.LocalSteps` syncs the replicas: validated at construction, the
    same for every front end.

    Example::

        >>> from gradshare import LocalStepsOptions
        >>> LocalStepsOptions(sync_every=30, overlap=2, fragments=5).tau
        2
    """

    sync_every: int = DEFAULT_SYNC_EVERY
    """H: inner steps between two syncs of a parameter (an int >= 1)."""

    density: float = DEFAULT_DENSITY
    """The fraction of each parameter's elements a sync sends, under 1/16
    (``QuantileThreshold(density)``), or 1.0 for exact float32 syncs (dense DiLoCo)."""

    decay: float = DEFAULT_DECAY
    """β in residual = β·residual + Δ, in [0, 1] (1: DL4J's residual, which forgets nothing)."""

    outer_optimizer: OuterFactory | None = None
    """A callable taking the global copy's tensors and returning the outer optimizer. None:
    plain SGD with :func:`default_outer_lr` (2.8 after an adaptive inner optimizer, else 1.4)."""

    offload: bool = False
    """Keep the global copy, residuals and outer state on the CPU (a model on CUDA)."""

    overlap: bool | int = False
    """τ: run each sync's exchange in the background during the next τ inner steps and merge
    it after them; an int in [0, ``sync_every``], True for ``sync_every``, False (0) for none."""

    fragments: int = 1
    """Sync the model in this many runs of consecutive parameters of about equal size, each
    in its turn (Streaming DiLoCo), so each exchange carries 1/fragments of the bytes."""

    compact: bool = True
    """Send sparse pieces in their compact form (the gaps' Rice code, about 7 bits per entry
    where DL4J's takes 32, where that is shorter: lossless, the same replicas bit for bit);
    False sends DL4J's format, which a DL4J decoder reads."""

    broadcast_buffers: bool = True
    """Make the model's buffers (BatchNorm's statistics) rank 0's at every sync, as DDP does
    before every forward; False leaves each rank's own."""

    def __post_init__(self) -> None:
        h = self.sync_every
        if isinstance(h, bool) or not isinstance(h, int) or h < 1:
            raise ValueError(
                f"Expect `sync_every` to be an int >= 1 (inner steps between syncs), got "
                f"{h!r}: pass e.g. sync_every=10."
            )
        d = self.density
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d <= 1:
            raise ValueError(
                f"Expect `density` in (0, 1], got {d!r}: it is the fraction of elements a "
                "sync sends (1.0: dense)."
            )
        b = self.decay
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 <= b <= 1:
            raise ValueError(
                f"Expect `decay` in [0, 1], got {b!r}: it is β in residual = β·residual + Δ "
                "(1: keep all of it, DL4J's residual)."
            )
        if self.outer_optimizer is not None and not callable(self.outer_optimizer):
            raise TypeError(
                f"Expect `outer_optimizer` to be a callable taking the global copy's tensors "
                f"(e.g. lambda p: torch.optim.SGD(p, lr=1.0)), got {self.outer_optimizer!r}."
            )
        _check_bool(self.offload, "offload", "True keeps the global copy on the CPU")
        _check_bool(
            self.compact,
            "compact",
            "True sends sparse pieces in their compact form, False in DL4J's",
        )
        _check_bool(
            self.broadcast_buffers,
            "broadcast_buffers",
            "True makes every rank's buffers rank 0's at each sync, as DDP does",
        )
        _check_overlap(self.overlap, h)
        f = self.fragments
        if isinstance(f, bool) or not isinstance(f, int) or not 1 <= f <= h:
            raise ValueError(
                f"Expect `fragments` to be an int from 1 to {h} (at most sync_every={h}, and "
                f"the model's parameter tensors), got {f!r}: pass e.g. fragments=1 (the whole "
                "model at each sync)."
            )
        if f > 1 and self.tau > h // f:
            raise ValueError(
                f"Expect `overlap` of at most {h // f} steps with fragments={f} and "
                f"sync_every={h} (a fragment's round must be merged before the next "
                f"fragment's sync), got {self.overlap!r}: lower `overlap` or `fragments`."
            )

    @property
    def tau(self) -> int:
        """τ: the inner steps each round's exchange runs in the background (0: no overlap)."""
        return self.sync_every if self.overlap is True else int(self.overlap)

    def check(self, threshold: Any, dense: bool, num_params: int) -> None:
        """Refuse what depends on the encoding options and the model: a density of 1/16 or
        more that is not 1.0 without a ``threshold`` algorithm, more fragments than
        parameter tensors."""
        if threshold is None and not dense and BITMAP_DENSITY <= self.density < 1:
            raise ValueError(
                f"Expect `density` under 1/16 or exactly 1.0, got {self.density!r}: at 1/16 "
                "or more a bitmap message is smaller than the sparse one; pass density=1.0 "
                "(dense syncs) or a `threshold` algorithm."
            )
        if self.fragments > num_params:
            raise ValueError(
                f"Expect `fragments` to be an int from 1 to {min(self.sync_every, num_params)} "
                f"(at most sync_every={self.sync_every} and the model's {num_params} parameter "
                f"tensors), got {self.fragments!r}: pass e.g. fragments=1 (the whole model at "
                "each sync)."
            )


FIELDS = tuple(f.name for f in dataclasses.fields(LocalStepsOptions))
"""The keywords every LocalSteps front end accepts."""


def local_steps_options(
    local: LocalStepsOptions | None, keywords: dict[str, Any], front_end: str
) -> LocalStepsOptions:
    """The options of a front end called with ``local=`` and/or the fields as keywords
    (``keywords`` holds only this dataclass's fields).

    Raises:
        TypeError: ``local`` is not a LocalStepsOptions, or a field is given both ways.
    """
    if local is None:
        return LocalStepsOptions(**keywords)
    if not isinstance(local, LocalStepsOptions):
        raise TypeError(
            f"Expect `local` to be a gradshare.LocalStepsOptions, got {type(local).__name__}."
        )
    if keywords:
        raise TypeError(
            f"{front_end} got `local` and the keyword(s) {sorted(keywords)}: pass them in one "
            "place (dataclasses.replace(local, ...) changes a field)."
        )
    return local


def default_outer_lr(inner: torch.optim.Optimizer) -> float:
    """The default outer optimizer's learning rate for ``inner``: :data:`DEFAULT_OUTER_LR` for
    an adaptive optimizer (:func:`~gradshare.distributed.metrics.is_adaptive`: Adam and its
    kin, their subclasses, wrappers such as accelerate's looked through), else
    :data:`DEFAULT_OUTER_LR_SGD`."""
    return DEFAULT_OUTER_LR if is_adaptive(inner) else DEFAULT_OUTER_LR_SGD


def outer_factory(options: LocalStepsOptions, inner: torch.optim.Optimizer) -> OuterFactory:
    """The outer optimizer's factory in force: the given one, or plain SGD at the default lr."""
    if options.outer_optimizer is not None:
        return options.outer_optimizer
    lr = default_outer_lr(inner)
    return lambda params: torch.optim.SGD(params, lr=lr)


def _check_bool(value: Any, name: str, meaning: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"Expect `{name}` True or False, got {value!r}: {meaning}.")


def _check_overlap(overlap: Any, sync_every: int) -> None:
    if not isinstance(overlap, int) or (
        not isinstance(overlap, bool) and not 0 <= overlap <= sync_every
    ):
        raise (ValueError if isinstance(overlap, int) else TypeError)(
            f"Expect `overlap` to be a bool or an int in [0, sync_every={sync_every}] (the inner "
            f"steps each sync's exchange runs in the background), got {overlap!r}: pass e.g. "
            "overlap=2, or overlap=True to merge at the next sync."
        )
