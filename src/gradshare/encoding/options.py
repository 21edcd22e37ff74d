"""The encoding settings every front end shares, declared once (docs/design.md §4).

The DDP hook, :class:`~gradshare.SharedOptimizer`, :class:`~gradshare.LocalSteps`,
:class:`~gradshare.ParallelWrapper`, :class:`~gradshare.EncodedGradientsAccumulator` and the
Lightning strategy each take these as keywords (or whole, as ``options=``) and build their
encoders from one :class:`EncodingOptions`; a test keeps their keywords the same.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

from gradshare import codec
from gradshare._checks import DEFAULT_TIMEOUT, to_seconds
from gradshare.encoding.encoder import Encoder
from gradshare.encoding.residual import ResidualPostProcessor
from gradshare.encoding.threshold import ThresholdAlgorithm, resolve

__all__ = ["EncodingOptions", "Reduction", "encoding_options"]

Reduction = Literal["sum", "mean"]


@dataclass(kw_only=True, slots=True, frozen=True)
class EncodingOptions:
    """How updates are encoded and combined: validated at construction, the same for every
    front end.

    Example::

        >>> from gradshare import EncodingOptions, QuantileThreshold
        >>> EncodingOptions(threshold=QuantileThreshold(0.01), reduction="mean").reduction
        'mean'
    """

    threshold: ThresholdAlgorithm | None = None
    """The threshold algorithm, cloned for each encoder (each worker, parameter or node keeps
    its own state). None: the front end's default (the adaptive rule started at 1e-3;
    :class:`~gradshare.LocalSteps`: ``QuantileThreshold(density)``)."""

    post_processor: ResidualPostProcessor | None = None
    """Residual post-processing after each message (DL4J's ``ResidualClipping``), cloned for
    each encoder. None: none."""

    boundary: int | None = None
    """The most entries a sparse message may carry (>= 1), or None for no cap."""

    magnitude: Literal["threshold", "mean"] = "threshold"
    """What each sent entry carries: ``"threshold"`` (t, DL4J's encoder) or ``"mean"`` (the
    mean magnitude of the sent elements, taken out of the residual exactly)."""

    dense: bool = False
    """Share the exact dense values instead (the oracle to compare with); no threshold then."""

    reduction: Reduction | None = None
    """How the ranks' (or workers') decoded messages combine: ``"sum"`` (DL4J) or ``"mean"``.
    None: ``"mean"`` where gradshare stands in for an average (the DDP hook, ``SharedOptimizer``
    with ``ddp=``, ``LocalSteps``, Lightning), else ``"sum"`` (DL4J's accumulator,
    ``ParallelWrapper``, ``SharedOptimizer`` alone)."""

    timeout: float | timedelta | None = None
    """How long a collective (or party) waits for the others before raising, in seconds or a
    ``timedelta``. None: :data:`gradshare._checks.DEFAULT_TIMEOUT` (300 s)."""

    def __post_init__(self) -> None:
        if self.threshold is not None:
            resolve(self.threshold)  # refuses anything but a ThresholdAlgorithm
        if self.post_processor is not None and not isinstance(
            self.post_processor, ResidualPostProcessor
        ):
            raise TypeError(
                f"Expect `post_processor` to be a ResidualPostProcessor or None, got "
                f"{type(self.post_processor).__name__}."
            )
        codec.check_boundary(self.boundary)
        codec.check_magnitude(self.magnitude)
        if not isinstance(self.dense, bool):
            raise TypeError(f"Expect `dense` to be a bool, got {self.dense!r}.")
        if self.dense and self.threshold is not None:
            raise ValueError(
                "Expect no `threshold` with `dense=True` (dense sharing sends every value "
                f"exactly), got {self.threshold!r}: drop one of them."
            )
        if self.reduction not in (None, "sum", "mean"):
            raise ValueError(f'Expect `reduction` "sum", "mean" or None, got {self.reduction!r}.')
        to_seconds(self.timeout)

    # ------------------------------------------------------------------ what front ends use

    def reduce(self, default: Reduction) -> Reduction:
        """The reduction in force: :attr:`reduction`, or the front end's ``default``."""
        return default if self.reduction is None else self.reduction

    def seconds(self) -> float:
        """The timeout in seconds (:data:`DEFAULT_TIMEOUT` for None)."""
        return DEFAULT_TIMEOUT if self.timeout is None else to_seconds(self.timeout)

    def algorithm(self, default: ThresholdAlgorithm | None = None) -> ThresholdAlgorithm | None:
        """A fresh threshold algorithm for one encoder (None with ``dense=True``): a clone of
        :attr:`threshold`, else of ``default``, else the adaptive rule started at 1e-3."""
        if self.dense:
            return None
        source = self.threshold or default
        return resolve(None if source is None else source.clone())

    def encoder(self, default: ThresholdAlgorithm | None = None) -> Encoder:
        """A fresh :class:`~gradshare.Encoder` with these settings (its own algorithm and
        post-processor)."""
        algorithm = self.algorithm(default)
        if algorithm is None:
            raise ValueError("`dense=True` sends exact values: there is no encoder to build.")
        return Encoder(
            algorithm,
            copy.deepcopy(self.post_processor),
            self.boundary,
            magnitude=self.magnitude,
        )


FIELDS = tuple(f.name for f in dataclasses.fields(EncodingOptions))
"""The keywords every front end accepts."""


def encoding_options(
    options: EncodingOptions | None, keywords: dict[str, Any], front_end: str
) -> EncodingOptions:
    """The options of a front end called with ``options=`` and/or the fields as keywords.

    Raises:
        TypeError: an unknown keyword (naming the ones there are), or a field given both ways.
    """
    unknown = sorted(set(keywords) - set(FIELDS))
    if unknown:
        raise TypeError(
            f"{front_end} got unexpected keyword(s) {unknown}: its encoding keywords are "
            f"{list(FIELDS)} (gradshare.EncodingOptions)."
        )
    if options is None:
        return EncodingOptions(**keywords)
    if not isinstance(options, EncodingOptions):
        raise TypeError(
            f"Expect `options` to be a gradshare.EncodingOptions, got {type(options).__name__}."
        )
    if keywords:
        raise TypeError(
            f"{front_end} got `options` and the keyword(s) {sorted(keywords)}: pass them in "
            "one place (dataclasses.replace(options, ...) changes a field)."
        )
    return options
