"""Threshold algorithms: how t moves from message to message (docs/design.md §2).

Ports of DL4J's ``AdaptiveThresholdAlgorithm``, ``TargetSparsityThresholdAlgorithm`` and
``FixedThresholdAlgorithm``, with their reducer (:meth:`ThresholdAlgorithm.average`). Every
algorithm answers ``calculate_threshold(iteration, epoch, last_threshold, last_was_dense,
last_density)``; the three ``last_*`` are None on the first call, and ``last_density`` is None
after a dense (bitmap) message.

One word throughout: the **density** of a message is the fraction of elements it sends,
entries / N (what DL4J calls "sparsity": its ``minTargetSparsity`` is ``min_density`` here and
its ``TargetSparsityThresholdAlgorithm`` is :class:`TargetDensityThreshold`). Checkpoints
saved under the old names load.
"""

from __future__ import annotations

import abc
import copy
import math
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from gradshare._checks import check_int

__all__ = [
    "DEFAULT_DECAY",
    "DEFAULT_INITIAL",
    "THRESHOLD_SPAN",
    "AdaptiveThreshold",
    "FixedThreshold",
    "QuantileThreshold",
    "TargetDensityThreshold",
    "ThresholdAlgorithm",
    "default_threshold",
    "sends_whole",
]

DEFAULT_DECAY = 0.5 ** (1 / 20)
"""DL4J's decay: t halves (or doubles) over 20 steps outside the target band."""
BITMAP_DENSITY = 1 / 16
"""The density assumed after a bitmap message, which carries no count of its own."""
THRESHOLD_SPAN = 1e6
"""How far the adaptive algorithms let t move from ``initial`` by default, as a factor either way.

Without a floor, steps that send nothing (zero updates: frozen layers, a paused loss) shrink t by
``decay`` each, forever: after 1,500 of them t is 2.7e-26 and climbing back takes about as many
steps. With the floor at ``initial / THRESHOLD_SPAN`` (and the ceiling at ``initial *
THRESHOLD_SPAN``) that is at most ~400 steps with the default decay, while ordinary training,
whose update magnitudes stay within a millionth of the ``initial`` one picks near them, never
reaches either bound. The bounds are relative so they suit any scale of ``initial``.
"""


def _positive(name: str, value: float, why: str) -> float:
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"Expect `{name}` finite and > 0, got {value!r}: {why}")
    return value


def _decay(value: float) -> float:
    value = float(value)
    if not 0.5 <= value < 1:
        raise ValueError(
            f"Expect `decay` in [0.5, 1), got {value!r}: a decay of 1 or more never lowers "
            "the threshold, one under 0.5 makes it jump by more than 2x a step."
        )
    return value


class ThresholdAlgorithm(abc.ABC):
    """Decide the threshold t of the next message from how the last one went.

    Subclasses keep their settings in ``_settings`` and their state in ``_state``; one
    instance belongs to one worker (use :meth:`clone` to hand out copies).
    """

    _settings_names: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self.samples = 0
        """How many magnitudes of the vector about to be encoded the algorithm wants to see
        (:meth:`observe`) before each :meth:`calculate_threshold`; 0 for DL4J's algorithms,
        which decide from the last message alone."""
        self.last_threshold: float | None = None
        """The threshold this algorithm returned last (None before the first call)."""
        self.last_density: float | None = None
        """The density it last acted on (None before one was known)."""

    @abc.abstractmethod
    def calculate_threshold(
        self,
        iteration: int,
        epoch: int,
        last_threshold: float | None,
        last_was_dense: bool | None,
        last_density: float | None,
    ) -> float:
        """Return the threshold for the message of ``iteration``."""

    def observe(self, magnitudes: torch.Tensor) -> None:  # noqa: B027 - optional
        """See ``|residual + update|`` at evenly spread elements (only if :attr:`samples`)."""

    def settings(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in self._settings_names}

    def state_dict(self) -> dict[str, Any]:
        """Settings and state, enough for a restored algorithm to continue identically."""
        return {
            "class": type(self).__name__,
            "settings": self.settings(),
            "last_threshold": self.last_threshold,
            "last_density": self.last_density,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` of the same class and settings; else raise ValueError."""
        state = _renamed(state)
        missing = {"class", "settings", "last_threshold", "last_density"} - set(state)
        if missing:
            raise ValueError(f"Threshold state is missing {sorted(missing)}.")
        if state["class"] != type(self).__name__:
            raise ValueError(
                f"Threshold state is of {state['class']}, this algorithm is "
                f"{type(self).__name__}: build the same algorithm before loading."
            )
        if state["settings"] != self.settings():
            raise ValueError(
                f"Threshold state has settings {state['settings']}, this algorithm has "
                f"{self.settings()}: build it with the saved settings."
            )
        self.last_threshold = state["last_threshold"]
        self.last_density = state["last_density"]

    def clone(self) -> ThresholdAlgorithm:
        """A new, independent algorithm with the same settings and state."""
        return copy.deepcopy(self)

    @staticmethod
    def average(algorithms: Sequence[ThresholdAlgorithm]) -> ThresholdAlgorithm:
        """DL4J's reducer: one algorithm whose last threshold and density are the workers' means.

        A new epoch (or a restarted run) then resumes from where the workers were. As in DL4J,
        the settings may differ (say two AdaptiveThresholds started at 1e-4 and 5e-4): the
        result is a copy of the first algorithm, settings included, with the averaged state.
        Workers that have no last threshold (or density) yet are left out of that mean.

        Raises:
            ValueError: no algorithms.
            TypeError: algorithms of different classes, whose states mean different things.
        """
        if not algorithms:
            raise ValueError("Expect at least one algorithm to average, got none.")
        first = algorithms[0]
        for other in algorithms[1:]:
            if type(other) is not type(first):
                raise TypeError(
                    f"Expect algorithms of one class to average, got {type(first).__name__} "
                    f"and {type(other).__name__}: give every worker the same kind of algorithm."
                )
        out = first.clone()
        out.last_threshold = _mean([a.last_threshold for a in algorithms])
        out.last_density = _mean([a.last_density for a in algorithms])
        return out

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.settings().items())
        return f"{type(self).__name__}({args})"


_OLD_NAMES = {
    "TargetSparsityThreshold": "TargetDensityThreshold",
    "min_sparsity": "min_density",
    "max_sparsity": "max_density",
    "last_sparsity": "last_density",
}
"""Names that checkpoints of gradshare 0.1 used, and what they are called now."""


def _renamed(state: dict[str, Any]) -> dict[str, Any]:
    """A threshold state dict with the names of gradshare 0.1 translated."""
    out = {_OLD_NAMES.get(k, k): v for k, v in state.items()}
    if isinstance(out.get("class"), str):
        out["class"] = _OLD_NAMES.get(out["class"], out["class"])
    if isinstance(out.get("settings"), dict):
        out["settings"] = {_OLD_NAMES.get(k, k): v for k, v in out["settings"].items()}
    if out.get("class") == "QuantileThreshold" and isinstance(out.get("settings"), dict):
        out["settings"].setdefault("warmup", 0)
    return out


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


class _BandThreshold(ThresholdAlgorithm):
    """Shared rule: lower t (x decay) below the band, raise it (/ decay) above it, and keep it
    within ``[min_threshold, max_threshold]``."""

    initial: float
    decay: float
    min_threshold: float
    max_threshold: float

    def _set_bounds(self, min_threshold: float | None, max_threshold: float | None) -> None:
        """Validate and store the bounds of t (defaults: ``initial`` / and * THRESHOLD_SPAN)."""
        why = "it bounds the threshold."
        low = self.initial / THRESHOLD_SPAN if min_threshold is None else min_threshold
        high = self.initial * THRESHOLD_SPAN if max_threshold is None else max_threshold
        self.min_threshold = _positive("min_threshold", low, why)
        self.max_threshold = _positive("max_threshold", high, why)
        if not self.min_threshold <= self.initial <= self.max_threshold:
            raise ValueError(
                f"Expect `min_threshold` <= `initial` <= `max_threshold`, got "
                f"{self.min_threshold!r}, {self.initial!r}, {self.max_threshold!r}: the first "
                "threshold must be one the algorithm may return; widen the bounds."
            )

    def _band(self) -> tuple[float, float]:
        raise NotImplementedError

    def calculate_threshold(
        self,
        iteration: int,
        epoch: int,
        last_threshold: float | None,
        last_was_dense: bool | None,
        last_density: float | None,
    ) -> float:
        if last_threshold is None and self.last_threshold is None:
            self.last_threshold = self.initial
            return self.initial
        base = last_threshold if last_threshold is not None else self.last_threshold
        assert base is not None
        if last_density is not None:
            s: float | None = last_density
        elif last_was_dense:
            s = BITMAP_DENSITY
        else:
            s = self.last_density
        low, high = self._band()
        if s is None:
            t = base
        elif s < low:
            t = base * self.decay
        elif s > high:
            t = base / self.decay
        else:
            t = base
        t = min(max(t, self.min_threshold), self.max_threshold)
        self.last_threshold, self.last_density = t, s
        return t


class AdaptiveThreshold(_BandThreshold):
    """Adapt t to keep the density of messages inside ``[min_density, max_density]``.

    The default everywhere. Below the band t is multiplied by ``decay``, above it divided by it,
    inside it kept. After a bitmap message the density is taken as 1/16 (too dense: t rises).

    Tuning: ``initial`` only matters for the first steps (it adapts by 2x per 20 steps with the
    default decay); pick it near the typical magnitude of a good update element. Widen the band
    to let t rest more, narrow it to hold the wire budget tighter.

    t never leaves ``[min_threshold, max_threshold]`` (gradshare's addition; DL4J's t decays
    without end while nothing is sent). The defaults, ``initial`` divided and multiplied by
    :data:`THRESHOLD_SPAN` (1e6), only stop a runaway: see there.

    Args:
        initial: the first threshold, > 0.
        min_density: lower edge of the target band, > 0.
        max_density: upper edge, >= ``min_density``.
        decay: the factor per step, in [0.5, 1).
        min_threshold: the smallest t returned, in (0, ``initial``]; None for
            ``initial / THRESHOLD_SPAN``.
        max_threshold: the largest t returned, finite and >= ``initial``; None for
            ``initial * THRESHOLD_SPAN``.
    """

    _settings_names = (
        "initial",
        "min_density",
        "max_density",
        "decay",
        "min_threshold",
        "max_threshold",
    )

    def __init__(
        self,
        initial: float = 1e-4,
        min_density: float = 1e-4,
        max_density: float = 1e-2,
        decay: float = DEFAULT_DECAY,
        *,
        min_threshold: float | None = None,
        max_threshold: float | None = None,
    ) -> None:
        super().__init__()
        self.initial = _positive("initial", initial, "it is the first threshold.")
        self.min_density = _positive("min_density", min_density, "it is a fraction sent.")
        self.max_density = _positive("max_density", max_density, "it is a fraction sent.")
        if self.min_density > self.max_density:
            raise ValueError(
                f"Expect `min_density` <= `max_density`, got {min_density!r} > "
                f"{max_density!r}: swap them."
            )
        self.decay = _decay(decay)
        self._set_bounds(min_threshold, max_threshold)

    def _band(self) -> tuple[float, float]:
        return self.min_density, self.max_density


class TargetDensityThreshold(_BandThreshold):
    """Adapt t toward one target density: below it x ``decay``, above it / ``decay``.

    DL4J's ``TargetSparsityThresholdAlgorithm``.

    Like :class:`AdaptiveThreshold`, t stays within ``[min_threshold, max_threshold]``.

    Args:
        initial: the first threshold, > 0.
        target: the density to hold, in (0, 1/16) (past 1/16 a bitmap is smaller anyway).
        decay: the factor per step, in [0.5, 1).
        min_threshold: the smallest t returned, in (0, ``initial``]; None for
            ``initial / THRESHOLD_SPAN``.
        max_threshold: the largest t returned, finite and >= ``initial``; None for
            ``initial * THRESHOLD_SPAN``.
    """

    _settings_names = ("initial", "target", "decay", "min_threshold", "max_threshold")

    def __init__(
        self,
        initial: float = 1e-4,
        target: float = 1e-3,
        decay: float = DEFAULT_DECAY,
        *,
        min_threshold: float | None = None,
        max_threshold: float | None = None,
    ) -> None:
        super().__init__()
        self.initial = _positive("initial", initial, "it is the first threshold.")
        target = float(target)
        if not 0 < target < BITMAP_DENSITY:
            raise ValueError(
                f"Expect `target` in (0, 1/16), got {target!r}: at 1/16 and above every "
                "message is a bitmap."
            )
        self.target = target
        self.decay = _decay(decay)
        self._set_bounds(min_threshold, max_threshold)

    def _band(self) -> tuple[float, float]:
        return self.target, self.target


class FixedThreshold(ThresholdAlgorithm):
    """Always the same threshold.

    Args:
        threshold: t, > 0.
    """

    _settings_names = ("threshold",)

    def __init__(self, threshold: float) -> None:
        super().__init__()
        self.threshold = _positive("threshold", threshold, "each sent entry moves by t.")

    def calculate_threshold(
        self,
        iteration: int,
        epoch: int,
        last_threshold: float | None,
        last_was_dense: bool | None,
        last_density: float | None,
    ) -> float:
        self.last_threshold = self.threshold
        if last_density is not None:
            self.last_density = last_density
        return self.threshold


class QuantileThreshold(ThresholdAlgorithm):
    """Set t every step so that a chosen fraction of the elements crosses it (sampled top-k).

    Before each message the encoder shows this algorithm ``|residual + update|`` at up to
    ``sample`` evenly spread elements; t is the magnitude that ``density`` of them reach, so
    the message carries about ``density · N`` entries from the first step on, whatever the
    scale of the updates (DGC's sampled top-k selection, Lin et al. 2018). DL4J's adaptive
    rule instead moves t by at most 3.5% a step toward its band, which takes tens of steps
    after a start or a change of scale. The messages are ordinary DL4J messages.

    With ``warmup`` > 0 the density starts at :data:`WARMUP_START` (25%, DGC's first warm-up
    epoch; such messages are bitmaps) and falls geometrically to ``density`` over the first
    ``warmup`` iterations (:meth:`density_at`), so early training, where gradients change
    fastest, sees most of them.

    Args:
        density: the fraction of elements to send, in (0, 1/16) (at 1/16 and above a bitmap is
            smaller than the sparse message).
        sample: how many elements to look at per step (>= 100).
        warmup: iterations of the falling warm-up density (>= 0; 0: none).
    """

    _settings_names = ("density", "sample", "warmup")

    def __init__(self, density: float = 1e-2, sample: int = 16_384, warmup: int = 0) -> None:
        super().__init__()
        if not (isinstance(density, (int, float)) and 0 < density < BITMAP_DENSITY):
            raise ValueError(
                f"Expect `density` in (0, 1/16), got {density!r}: at 1/16 or more a bitmap "
                "message is smaller; use AdaptiveThreshold for such dense updates."
            )
        check_int(sample, "sample", 100)
        check_int(warmup, "warmup", 0)
        self.density = float(density)
        self.sample = self.samples = sample
        self.warmup = warmup
        self._magnitudes: torch.Tensor | None = None

    def density_at(self, iteration: int) -> float:
        """The density aimed at in ``iteration``: ``density`` after the warm-up."""
        if iteration >= self.warmup:
            return self.density
        return WARMUP_START * (self.density / WARMUP_START) ** (iteration / self.warmup)

    def observe(self, magnitudes: torch.Tensor) -> None:
        self._magnitudes = magnitudes

    def calculate_threshold(
        self,
        iteration: int,
        epoch: int,
        last_threshold: float | None,
        last_was_dense: bool | None,
        last_density: float | None,
    ) -> float:
        if last_density is not None:
            self.last_density = last_density
        t = None
        if self._magnitudes is not None:
            m = self._magnitudes.reshape(-1).float()
            k = max(min(2, m.numel()), round(self.density_at(iteration) * m.numel()))
            q = _kth_largest(m, k)
            t = q if q > 0 and math.isfinite(q) else None
            self._magnitudes = None
        if t is None:  # nothing non-zero seen: keep the last t (nothing crosses it anyway)
            t = self.last_threshold if self.last_threshold is not None else DEFAULT_INITIAL
        self.last_threshold = t
        return t


def _kth_largest(m: torch.Tensor, k: int) -> float:
    """The least of the ``k`` largest of ``m`` (NaN when they hold a NaN, which sorts as the
    largest): ``torch.topk(m, k).values.min()``, by numpy's partition on the CPU (7x faster
    for 16,384 samples), which orders NaN alike and picks the same values."""
    if m.device.type != "cpu":
        return float(torch.topk(m, k, sorted=False).values.min())
    x = m.numpy()
    return float(np.partition(x, x.size - k)[x.size - k :].min())


WARMUP_START = 0.25
"""The density a :class:`QuantileThreshold` warm-up starts from (DGC's first warm-up epoch)."""


DEFAULT_INITIAL = 1e-3
"""The initial threshold of :func:`default_threshold`."""


WHOLE_BELOW = 16
"""Vectors of fewer elements are sent whole (:func:`sends_whole`) under any algorithm but
:class:`QuantileThreshold`: one word of a bitmap's payload."""


def sends_whole(algorithm: ThresholdAlgorithm, numel: int) -> bool:
    """Whether a vector of ``numel`` elements is too small for threshold messages under
    ``algorithm``, and is sent whole instead (:meth:`gradshare.Encoder.encode_whole`).

    DL4J's rule sends no message when fewer than 2 elements cross t, so a 1-element vector
    would never be sent, and one whose crossing elements rarely come in pairs would be held
    back for long. Under :class:`QuantileThreshold` a vector is too small when the entries it
    aims at, ``round(density · N)``, are fewer than 2 (N < 38 at the default 4 %); under any
    other algorithm when N < :data:`WHOLE_BELOW`. Such vectors are a model's scalars, biases
    and norms of narrow layers: a few bytes against its matrices.
    """
    if isinstance(algorithm, QuantileThreshold):
        return numel < 2
    return numel < WHOLE_BELOW


def default_threshold() -> AdaptiveThreshold:
    """The algorithm every gradshare component uses when given ``threshold=None``:
    ``AdaptiveThreshold(DEFAULT_INITIAL)``, DL4J's adaptive rule started at 1e-3.

    (``AdaptiveThreshold()`` itself keeps DL4J's own initial value, 1e-4, which is too small for
    typical updates: its first messages are all bitmaps of ±t steps.)
    """
    return AdaptiveThreshold(DEFAULT_INITIAL)


def resolve(threshold: ThresholdAlgorithm | None) -> ThresholdAlgorithm:
    """``threshold`` checked, or :func:`default_threshold` for None (a fresh instance)."""
    if threshold is None:
        return default_threshold()
    if not isinstance(threshold, ThresholdAlgorithm):
        raise TypeError(
            f"Expect `threshold` to be a ThresholdAlgorithm or None, got "
            f"{type(threshold).__name__}: wrap a number as FixedThreshold(t)."
        )
    return threshold
