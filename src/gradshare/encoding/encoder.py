"""One worker's encoder: residual + threshold algorithm + format choice + stats (docs/design.md §4).

The port of DL4J's ``EncodingHandler``, with two deliberate improvements: the format (sparse or
bitmap) is chosen from the count *before* the residual is touched, so no update is lost on a
switch, and a configured ``boundary`` is honoured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from gradshare import codec
from gradshare.encoding.residual import NoResidualProcessing, ResidualPostProcessor
from gradshare.encoding.threshold import ThresholdAlgorithm, resolve

__all__ = ["EncodeStats", "Encoder", "sample_span"]


@dataclass(frozen=True, slots=True)
class EncodeStats:
    """What one :meth:`Encoder.encode` call did."""

    iteration: int
    threshold: float
    """t used to select this message's elements (float32-rounded)."""
    value: float
    """The float32 each entry sends (the header's float): t, or with ``magnitude="mean"`` the
    mean magnitude of the sent elements (t when nothing was sent)."""
    format: str | None
    """``"sparse"``, ``"bitmap"``, ``"dense"`` (:meth:`Encoder.encode_whole`), or None when
    nothing was sent."""
    entries: int
    """Elements the message moves."""
    density: float
    """``entries / numel``: the kept fraction."""
    message_bytes: int
    """Bytes on the wire (0 when nothing was sent)."""
    dense_bytes: int
    """Bytes of the same update sent dense in float32."""
    clipped: float
    """L1 mass the post-processor dropped from the residual this step."""
    residual_norm: float
    """L2 norm of the residual after encoding and post-processing."""

    @property
    def compression_ratio(self) -> float:
        """Dense bytes / sent bytes (``inf`` when nothing was sent)."""
        return self.dense_bytes / self.message_bytes if self.message_bytes else math.inf


class Encoder:
    """Turn a stream of updates into threshold-encoded messages, keeping what is not sent.

    Each call of :meth:`encode`:

    1. checks the update is finite (else raises, residual untouched);
    2. asks the threshold algorithm for t, given the last message's threshold and sparsity;
    3. adds the update into the float32 residual and counts the elements with ``|x| >= t``
       in the same pass;
    4. picks the format from that count: no message when fewer than 2 qualify, whatever N
       (the residual is left as it is and the algorithm is told sparsity 0, so t falls);
       else DL4J's cut-off, a bitmap when ``K + 4 >= N // 16`` (K capped by ``boundary``),
       else sparse;
    5. encodes in place (only t per sent element leaves the residual; with
       ``magnitude="mean"`` the header carries m, the mean ``|x|`` of the sent elements, and
       m leaves per sent element) and post-processes.

    ``magnitude="mean"`` sends more of the residual per entry (m >= t) in the same bytes,
    and any DL4J decoder still reads the message. The threshold algorithm still sees t and
    the density, as with ``"threshold"``. A bitmap then sends no half steps.

    The conservation law holds at every step: the sum of all updates equals the sum of all
    decoded messages plus the residual plus the clipped mass, to float rounding.

    Args:
        threshold: the threshold algorithm (None:
            :func:`gradshare.encoding.threshold.default_threshold`). It is owned by this encoder:
            pass a fresh one per worker.
        post_processor: residual post-processing after each message (default none).
        boundary: the most entries a sparse message may carry, or None.
        magnitude: the header's float: ``"threshold"`` (t, DL4J's encoder) or ``"mean"``
            (the float32 mean magnitude of the sent elements). A setting: a
            :meth:`load_state_dict` of a state saved with another one is refused.

    Example::

        >>> import torch
        >>> from gradshare import Encoder, FixedThreshold, decode_
        >>> enc = Encoder(FixedThreshold(0.5))
        >>> msg = enc.encode(torch.tensor([1.5, 2.5, -3.5]), iteration=0)
        >>> msg.tolist(), enc.residual.tolist()
        ([3, 3, 1056964608, 0, 1, 2, -3], [1.0, 2.0, -3.0])
    """

    def __init__(
        self,
        threshold: ThresholdAlgorithm | None = None,
        post_processor: ResidualPostProcessor | None = None,
        boundary: int | None = None,
        magnitude: Literal["threshold", "mean"] = "threshold",
    ) -> None:
        codec.check_boundary(boundary)
        self._mean = codec.check_magnitude(magnitude)
        self.magnitude = magnitude
        self.algorithm: ThresholdAlgorithm = resolve(threshold)
        self.post_processor: ResidualPostProcessor = post_processor or NoResidualProcessing()
        self.boundary = boundary
        self.residual: torch.Tensor | None = None
        """The float32 residual: what was added and not yet sent (None before the first call)."""
        self.last_stats: EncodeStats | None = None
        self._last: tuple[float | None, bool | None, float | None] = (None, None, None)
        self._staging: torch.Tensor | None = None
        self._ws = codec.Workspace()

    # ------------------------------------------------------------------ encode

    def _prepare(self, update: torch.Tensor) -> torch.Tensor:
        """Return ``update`` as a flat float32 tensor on the residual's device."""
        if not isinstance(update, torch.Tensor):
            raise TypeError(f"Expect `update` to be a torch.Tensor, got {type(update).__name__}.")
        flat = update.detach().reshape(-1)
        codec.check_vector(flat, "update")
        if flat.numel() == 0:
            raise ValueError(
                f"Expect `update` to have at least 1 element, got shape {tuple(update.shape)}: "
                "an empty update has nothing to encode; leave it out of the encoder."
            )
        if self.residual is None:
            self.residual = torch.zeros(flat.numel(), dtype=torch.float32, device=flat.device)
        elif flat.numel() != self.residual.numel():
            raise ValueError(
                f"Expect `update` of {self.residual.numel()} elements (this encoder's residual), "
                f"got {flat.numel()}: use one encoder per parameter vector."
            )
        if flat.dtype == torch.float32 and flat.device == self.residual.device:
            return flat
        if self._staging is None:
            self._staging = torch.empty_like(self.residual)
        return self._staging.copy_(flat)

    def encode(
        self,
        update: torch.Tensor | None,
        iteration: int,
        epoch: int = 0,
        *,
        finite: bool = False,
        magnitudes: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Add ``update`` into the residual and return this step's message (or None).

        Args:
            update: any-shape floating tensor with as many elements as the residual; the first
                call fixes that size and the device. None: the residual already holds this
                step's update (the caller added it, as :func:`gradshare.codec.decay_add_`
                does, in the pass that computes it), and is encoded as it is.
            iteration: the step number (drives the threshold algorithm and clipping frequency).
            epoch: the epoch number, passed through to the algorithms.
            finite: the caller already checked that ``update`` is finite
                (:func:`gradshare.codec.take_update_` does while computing it), so the
                encoder does not read it once more to check.
            magnitudes: with ``update=None``, ``|residual|`` at the elements the threshold
                algorithm samples (:func:`sample_span`), taken by the caller in the pass
                that made the residual; None: sampled here (a pass over the residual's
                cache lines of its own).

        Returns:
            An int32 message tensor, or None when fewer than 2 elements crossed the threshold.

        Raises:
            ValueError: the update has non-finite values (the residual is left unchanged), no
                elements, or the wrong number of elements.
        """
        u = None
        if update is not None:
            if magnitudes is not None:
                raise ValueError(
                    "Expect `magnitudes` only with `update=None` (they are the residual's, "
                    "sampled by the caller that made it), got both."
                )
            u = self._prepare(update)
            if not (finite and u.dtype == update.dtype):  # a cast to float32 may overflow
                _check_finite(u)
        residual = self.residual
        if residual is None:
            raise ValueError(
                "Expect an `update` at this encoder's first call: `update=None` encodes the "
                "residual as it is, and there is none yet. Pass the update, or set `residual`."
            )
        n = residual.numel()
        if self.algorithm.samples:
            if magnitudes is None:
                magnitudes = _sample(residual, u, self.algorithm.samples, iteration)
            self.algorithm.observe(magnitudes)
        t = codec.float32_threshold(
            self.algorithm.calculate_threshold(iteration, epoch, *self._last)
        )
        count = self._ws.scan_(residual, u, t)
        limit = count if self.boundary is None else min(count, self.boundary)
        message: torch.Tensor | None
        fmt: str | None
        if count < 2:  # scan_ has left the residual as it was
            message, entries, fmt = None, 0, None
            self._last = (t, False, 0.0)
        elif codec.sparse_length(limit) >= n // 16:
            message, entries = self._ws.bitmap_(residual, t, mean=self._mean)
            fmt = "bitmap"
            self._last = (t, True, None)
        else:
            message = self._ws.emit_(residual, limit, mean=self._mean)
            entries, fmt = limit, "sparse"
            self._last = (t, False, entries / n)
        clipped = float(self.post_processor.process_(iteration, epoch, t, residual))
        sumsq = self._ws.sumsq if clipped == 0 else float(residual.double().square().sum())
        self.last_stats = EncodeStats(
            iteration=iteration,
            threshold=t,
            value=t if message is None else self._ws.value,
            format=fmt,
            entries=entries,
            density=entries / n,
            message_bytes=0 if message is None else message.numel() * 4,
            dense_bytes=n * 4,
            clipped=clipped,
            residual_norm=math.sqrt(max(sumsq, 0.0)),
        )
        return message

    def encode_whole(self, update: torch.Tensor | None, iteration: int) -> torch.Tensor:
        """Add ``update`` into the residual and send all of it: return its dense piece
        (:func:`gradshare.codec.encode_dense_`, the float32 values) and leave the residual
        at zero.

        For a vector too small for threshold messages
        (:func:`~gradshare.encoding.threshold.sends_whole`): the threshold algorithm is not
        asked and keeps its state; the stats say format ``"dense"`` and threshold 0. The
        conservation law holds exactly: what left the residual is what the piece decodes to.
        ``update`` is as in :meth:`encode` (None: the residual already holds it).
        """
        if update is not None:
            u = self._prepare(update)
            _check_finite(u)
            assert self.residual is not None
            self.residual.add_(u)
        if self.residual is None:
            raise ValueError(
                "Expect an `update` at this encoder's first call: `update=None` sends the "
                "residual as it is, and there is none yet."
            )
        message = codec.encode_dense_(self.residual)
        n = self.residual.numel()
        entries = codec.message_info(message).num_entries
        self.last_stats = EncodeStats(
            iteration=iteration,
            threshold=0.0,
            value=0.0,
            format="dense",
            entries=entries,
            density=entries / n,
            message_bytes=message.numel() * 4,
            dense_bytes=n * 4,
            clipped=0.0,
            residual_norm=0.0,
        )
        return message

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self, *, residual: bool = True) -> dict[str, Any]:
        """Residual, threshold-algorithm state and the last message's feedback.

        With ``residual=False`` the ``"residual"`` entry is None, not a copy: for a caller
        that keeps the residual itself, and puts its copy there before loading the state.
        """
        return {
            "residual": None
            if self.residual is None or not residual
            else self.residual.detach().clone(),
            "algorithm": self.algorithm.state_dict(),
            "post_processor": self.post_processor.state_dict(),
            "boundary": self.boundary,
            "magnitude": self.magnitude,
            "last": list(self._last),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; on any mismatch raise and change nothing.

        A state saved with another ``magnitude`` is refused (states from before that setting
        existed count as ``"threshold"``).
        """
        missing = {"residual", "algorithm", "post_processor", "boundary", "last"} - set(state)
        if missing:
            raise ValueError(f"Encoder state is missing {sorted(missing)}: is it an Encoder's?")
        residual = state["residual"]
        if residual is not None:
            if not isinstance(residual, torch.Tensor) or residual.dim() != 1:
                raise ValueError("Expect `residual` in the state to be a 1-D tensor.")
            if not bool(torch.isfinite(residual).all()):
                raise ValueError(
                    "Saved residual has non-finite values: those elements could never cross "
                    "the threshold again. The checkpoint is corrupted; resume from another."
                )
            if self.residual is not None and residual.numel() != self.residual.numel():
                raise ValueError(
                    f"Saved residual has {residual.numel()} elements, this encoder's has "
                    f"{self.residual.numel()}: the checkpoint is of another model."
                )
        codec.check_boundary(state["boundary"])
        saved = state.get("magnitude", "threshold")
        if saved != self.magnitude:
            raise ValueError(
                f"Saved encoder state has `magnitude` {saved!r}, this encoder {self.magnitude!r}:"
                f" build the encoder with magnitude={saved!r} to resume that run."
            )
        probe_alg = self.algorithm.clone()
        probe_alg.load_state_dict(state["algorithm"])
        self.post_processor.load_state_dict(state["post_processor"])
        self.algorithm.load_state_dict(state["algorithm"])
        self.boundary = state["boundary"]
        last = state["last"]
        self._last = (last[0], last[1], last[2])
        self._ws.drop_()  # a scan of the residual it replaces is void
        if residual is None:
            self.residual = None
        elif self.residual is None:
            self.residual = residual.detach().to(torch.float32).clone()
        elif residual is not self.residual:
            self.residual.copy_(residual)


def sample_span(numel: int, k: int, iteration: int) -> tuple[int, int]:
    """(start, stride) of the elements a threshold algorithm that asks for ``k`` samples sees
    in ``iteration``, of a vector of ``numel``: about ``k`` evenly spread ones (all when
    ``numel`` <= k), from an offset that moves with ``iteration`` (so no element is always
    skipped). A caller that makes the residual itself samples it there in the same pass
    (:func:`gradshare.codec.decay_add_`) and hands the magnitudes to :meth:`Encoder.encode`."""
    stride = 1 if numel <= k else numel // k
    return (0 if numel <= k else (iteration * 7919) % stride), stride


def _sample(residual: torch.Tensor, u: torch.Tensor | None, k: int, iteration: int) -> torch.Tensor:
    """``|residual + u|`` (``|residual|`` without ``u``) at the elements of
    :func:`sample_span`."""
    start, stride = sample_span(residual.numel(), k, iteration)
    picked = residual[start::stride]
    return (picked if u is None else picked + u[start::stride]).abs()


def _check_finite(u: torch.Tensor) -> None:
    """Raise ValueError naming how many values of ``u`` are non-finite and where the first is."""
    bad, first = codec.find_nonfinite(u)
    if bad:
        raise codec.nonfinite_error(u, bad, first, "nothing was added to the residual")
