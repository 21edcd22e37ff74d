"""The wire format: threshold encoding of a residual into int32 messages, and decoding back.

Byte-compatible with Deeplearning4j's ``EncodingHandler`` (docs/design.md §1). A message is a 1-D
little-endian ``int32`` tensor with a 4-word header ``[K or N, N, float32 bits of t, format]``
followed by either K signed 1-based indices (sparse, ``FLEXIBLE_ENCODING``) or ``N//16 + 1``
bitmap words (``BITMAP_ENCODING``, 2 bits per element).

Encoding works **in place** on the residual (only the encoded amount ``t`` leaves it; the
remainder stays, which is the error feedback of Strom 2015). With ``magnitude="mean"`` the
header's float is instead m, the mean magnitude of the sent elements (m >= t), and exactly
``±m`` leaves the residual per sent element: the format, and any DL4J decoder, are unchanged.
Decoding **adds** into its target and validates the whole message first: a bad message raises
:class:`MessageError` and leaves the target bit-for-bit untouched.

On CPU, float32 and float64 tensors go through fused numba kernels (:mod:`gradshare.codec._kernels`,
compiled on first use and cached on disk); CUDA tensors, float16 and bfloat16 go through
vectorised torch ops (:mod:`gradshare.codec._torch_paths`) with the same results. To run everything
on the torch ops (and never import numba), set ``GRADSHARE_KERNELS=0`` before importing
gradshare, or for a block of code::

    with codec.use_kernels(False):
        ...

This module holds the public functions and the checks of every argument and message; the work
is done by :class:`Workspace` (:mod:`gradshare.codec._workspace`) and
:mod:`gradshare.codec._dispatch`.

Example::

    >>> import torch
    >>> from gradshare.codec import encode_sparse_, decode_
    >>> residual = torch.tensor([1.5, 2.5, -3.5])
    >>> encode_sparse_(residual, 0.5).tolist()
    [3, 3, 1056964608, 0, 1, 2, -3]
    >>> residual.tolist()
    [1.0, 2.0, -3.0]
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gradshare.codec import _dispatch, compact_form
from gradshare.codec._dispatch import kernels_enabled, use_kernels
from gradshare.codec._dispatch import serial_kernels as serial_kernels
from gradshare.codec._format import (
    BITMAP_ENCODING,
    COMPACT_ENCODING,
    DENSE_ENCODING,
    F32,
    F32_MAX,
    F32_TINY,
    FLEXIBLE_ENCODING,
    FORMAT_NAMES,
    HEADER_WORDS,
    MAGNITUDES,
    MAX_NUMEL,
    MessageError,
    bitmap_length,
    bits_threshold,
    dense_length,
    mean_magnitude,
    read_words,
    sparse_length,
)
from gradshare.codec._workspace import Workspace as Workspace
from gradshare.codec._workspace import thread_workspace

__all__ = [
    "BITMAP_ENCODING",
    "COMPACT_ENCODING",
    "DENSE_ENCODING",
    "FLEXIBLE_ENCODING",
    "HEADER_WORDS",
    "MAGNITUDES",
    "MAX_NUMEL",
    "MessageError",
    "MessageInfo",
    "bitmap_length",
    "check_message",
    "decode_",
    "decode_sum_",
    "dense_length",
    "encode_bitmap_",
    "encode_dense_",
    "encode_sparse_",
    "kernels_enabled",
    "mean_magnitude",
    "message_info",
    "sparse_length",
    "subtract_sum_",
    "take_update_",
    "use_kernels",
]

# Also here, for gradshare's own modules (not public API): Workspace, serial_kernels, the check_*
# helpers, float32_threshold, shares_memory, find_nonfinite, nonfinite_error, NonFiniteUpdate,
# subtract_, decay_add_, decay_into_ and step_sum_.

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True, slots=True)
class MessageInfo:
    """What a message's header (and, for a bitmap, its payload) says."""

    format: int
    """``FLEXIBLE_ENCODING``, ``BITMAP_ENCODING``, ``COMPACT_ENCODING`` or
    ``DENSE_ENCODING``."""
    num_entries: int
    """Elements the message moves: K for sparse and compact, set 2-bit codes for bitmap,
    non-zero values for dense."""
    numel: int
    """N, the length of the vector it encodes."""
    threshold: float
    """The float32 stored in word 2: t, or the mean magnitude of a ``magnitude="mean"``
    message; each entry moves by it (0 for a dense piece, whose values are their own)."""
    nbytes: int
    """Size on the wire."""

    @property
    def format_name(self) -> str:
        return FORMAT_NAMES[self.format]


# --------------------------------------------------------------------------- checks


def check_vector(x: Any, name: str) -> None:
    """Raise unless ``x`` is a 1-D contiguous floating tensor that a message can address."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"Expect `{name}` to be a torch.Tensor, got {type(x).__name__}.")
    if x.dtype not in _FLOATS:
        raise TypeError(
            f"Expect `{name}` of dtype float16, bfloat16, float32 or float64, got {x.dtype}: "
            "messages carry real-valued updates; convert with `.float()`."
        )
    if x.dim() != 1:
        raise ValueError(
            f"Expect `{name}` to be 1-D, got shape {tuple(x.shape)}: flatten it with `.view(-1)`."
        )
    if not x.is_contiguous():
        raise ValueError(f"Expect `{name}` to be contiguous: call `.contiguous()` first.")
    if x.numel() > MAX_NUMEL:
        raise ValueError(
            f"Expect `{name}` to have fewer than 2**31 elements, got {x.numel()}: "
            "indices travel as signed int32; split the vector into several encoders."
        )


def _byte_span(x: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[lo, hi)`` that ``x``'s elements occupy (empty when it has none)."""
    numel = x.numel()
    if numel == 0:
        return 0, 0
    if x.is_contiguous():  # the common case, kept cheap: decode_ checks every message
        start = x.data_ptr()
        return start, start + numel * x.element_size()
    lo = hi = 0
    for size, stride in zip(x.shape, x.stride(), strict=True):
        reach = (size - 1) * stride
        lo, hi = lo + min(reach, 0), hi + max(reach, 0)
    size = x.element_size()
    start = x.data_ptr()
    return start + lo * size, start + (hi + 1) * size


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes of ``a``'s elements and ``b``'s overlap (same device only)."""
    if a.device != b.device:
        return False
    a_lo, a_hi = _byte_span(a)
    b_lo, b_hi = _byte_span(b)
    return a_lo < b_hi and b_lo < a_hi


def check_no_overlap(message: Any, target: torch.Tensor, what: str, name: str) -> None:
    """Raise MessageError if ``message`` (described by ``what``) lies in ``target``'s memory."""
    if isinstance(message, torch.Tensor) and shares_memory(message, target):
        raise MessageError(
            f"Expect {what} and `{name}` in separate memory, but they share bytes: decoding "
            f"writes `{name}` while it reads the message, so entries already checked would "
            "change under it. Clone the message first (`message.clone()`)."
        )


def float32_threshold(threshold: float) -> float:
    """Return ``threshold`` rounded to float32 (as the wire stores it), or raise ValueError."""
    try:
        t = F32.unpack(F32.pack(threshold))[0]
    except (OverflowError, TypeError, struct.error):
        t = math.inf
    if not (math.isfinite(t) and t > 0):
        raise ValueError(
            f"Expect `threshold` finite and > 0 in float32, got {threshold!r}: "
            "t is the step each sent entry moves by."
        )
    return t


def check_magnitude(magnitude: Any) -> bool:
    """Return whether ``magnitude`` asks for the mean (``"mean"``), or raise ValueError."""
    if magnitude not in MAGNITUDES:
        raise ValueError(
            f"Expect `magnitude` to be 'threshold' or 'mean', got {magnitude!r}: the header's "
            "float is either t or the mean magnitude of the elements the message sends."
        )
    return bool(magnitude == "mean")


def check_boundary(boundary: int | None) -> None:
    """Raise unless ``boundary`` (the most entries a message may carry) is an int >= 1 or None."""
    if boundary is not None and (isinstance(boundary, bool) or not isinstance(boundary, int)):
        raise TypeError(f"Expect `boundary` to be an int or None, got {type(boundary).__name__}.")
    if boundary is not None and boundary < 1:
        raise ValueError(
            f"Expect `boundary` >= 1 or None, got {boundary}: it caps the entries of a message."
        )


# --------------------------------------------------------------------------- updates


def find_nonfinite(x: torch.Tensor) -> tuple[int, int]:
    """Return (number of non-finite elements of a 1-D tensor, index of the first or -1)."""
    return _first_nonfinite(x, _dispatch.count_nonfinite(x))


def _first_nonfinite(x: torch.Tensor, bad: int) -> tuple[int, int]:
    if not bad:
        return 0, -1
    return bad, int(torch.nonzero(~torch.isfinite(x))[0, 0])


class NonFiniteUpdate(ValueError):
    """An update with inf or NaN in it: training diverged (or the loss did). A ValueError, so
    that callers catching that keep working; the CLI tells it apart to report a divergence."""


def nonfinite_error(x: torch.Tensor, bad: int, first: int, consequence: str) -> NonFiniteUpdate:
    """The error for an update ``x`` with ``bad`` non-finite values, the first at ``first``."""
    return NonFiniteUpdate(
        f"`update` has {bad} non-finite value(s), the first at flat index {first} "
        f"({float(x[first])}): {consequence}. Check the loss or lower the learning rate."
    )


def take_update_(
    before: torch.Tensor, after: torch.Tensor, out: torch.Tensor, *, restore: bool = False
) -> torch.Tensor:
    """``out = before - after``, the update an optimizer step made, checked to be finite.

    With ``restore`` the parameters ``after`` are also put back to ``before``. On CPU it is
    one pass over the three vectors (the check rides along, so the encoder need not read the
    update again: pass ``finite=True`` to :meth:`gradshare.Encoder.encode`).

    Raises:
        ValueError: the update has non-finite values (``out`` holds it; ``after`` is
            restored all the same when asked).
    """
    for name, x in (("before", before), ("after", after), ("out", out)):
        check_vector(x, name)
        if x.shape != before.shape or x.dtype != before.dtype or x.device != before.device:
            raise ValueError(
                f"Expect `{name}` like `before` ({before.dtype}, {tuple(before.shape)}, "
                f"{before.device}), got {x.dtype}, {tuple(x.shape)}, {x.device}."
            )
    bad = _dispatch.take_update_(before, after, out, restore)
    bad, first = _first_nonfinite(out, bad)
    if bad:
        raise nonfinite_error(out, bad, first, "nothing was shared")
    return out


def subtract_(
    before: torch.Tensor, after: torch.Tensor, out: torch.Tensor, *,
    plus: torch.Tensor | None = None, then: torch.Tensor | None = None,
) -> int:  # fmt: skip
    """``out = (before + plus) - after`` (``before - after`` without ``plus``), rounded as
    torch's ``add`` then ``sub`` round it, then ``after = then`` when given; the number of
    non-finite elements of ``out``.

    On CPU it is one pass over the vectors, the count included (for a caller that names
    what is not finite instead of raising, where :func:`take_update_` raises). ``out`` may
    be ``before`` (LocalSteps' carry, ``base -= local``, as its replica takes the global copy
    ``then``).
    """
    _check_like(before, after=after, out=out, plus=plus, then=then, like="before")
    return _dispatch.take_update_(before, after, out, False, plus, then)


def decay_add_(
    residual: torch.Tensor, factor: float, backup: torch.Tensor, before: torch.Tensor,
    after: torch.Tensor, *, plus: torch.Tensor | None = None, out: torch.Tensor | None = None,
    sample: tuple[torch.Tensor, int, int] | None = None, copy: torch.Tensor | None = None,
) -> int:  # fmt: skip
    """``backup = residual``, then ``residual = residual * factor + d`` with the difference
    ``d = (before + plus) - after`` (``before - after`` without ``plus``; also written to
    ``out`` when given), rounded as torch's ``add``, ``sub``, ``mul`` and ``add`` round them;
    the number of non-finite elements of the new residual.

    Error feedback with decay in one pass over the vectors on CPU, the count included: the
    caller encodes the residual with ``Encoder.encode(None, ...)``, and puts ``backup`` back
    when the round fails (a non-finite ``d`` makes its element of the residual non-finite).
    ``sample = (magnitudes, start, stride)`` also writes ``magnitudes[i] = |residual[start +
    i * stride]|`` (the new residual) in the same pass: what a threshold algorithm samples
    (:func:`gradshare.encoding.encoder.sample_span`); ``copy`` takes ``after`` as it is
    (LocalSteps' send point).
    """
    _check_like(residual, backup=backup, before=before, after=after, plus=plus, out=out,
                copy=copy)  # fmt: skip
    sample = _checked_sample(residual, sample)
    return _dispatch.decay_add_(residual, factor, residual, backup, before, after, plus, out,
                                sample, copy)  # fmt: skip


def decay_into_(
    residual: torch.Tensor, factor: float, into: torch.Tensor, before: torch.Tensor,
    after: torch.Tensor, *, plus: torch.Tensor | None = None, out: torch.Tensor | None = None,
    sample: tuple[torch.Tensor, int, int] | None = None, copy: torch.Tensor | None = None,
) -> int:  # fmt: skip
    """:func:`decay_add_` that writes the new residual into ``into`` and leaves ``residual``
    as it was (it is then the backup; the caller swaps the two): ``into = residual * factor +
    d``, one write fewer than a backup's copy. The number of non-finite elements of ``into``.
    """
    _check_like(residual, into=into, before=before, after=after, plus=plus, out=out, copy=copy)
    if shares_memory(residual, into):
        raise ValueError("Expect `into` in memory of its own, apart from `residual`.")
    sample = _checked_sample(into, sample)
    return _dispatch.decay_add_(residual, factor, into, None, before, after, plus, out,
                                sample, copy)  # fmt: skip


def _check_like(first: torch.Tensor, like: str = "residual", **others: Any) -> None:
    """Raise unless every tensor of ``others`` (None: absent) is like ``first``, which the
    error calls ``like``."""
    for name, x in others.items():
        if x is not None and (
            x.shape != first.shape or x.dtype != first.dtype or x.device != first.device
        ):
            raise ValueError(
                f"Expect `{name}` like `{like}` ({first.dtype}, {tuple(first.shape)}, "
                f"{first.device}), got {x.dtype}, {tuple(x.shape)}, {x.device}."
            )


def _checked_sample(
    x: torch.Tensor, sample: tuple[torch.Tensor, int, int] | None
) -> tuple[torch.Tensor, int, int] | None:
    """``sample`` after checking that its magnitudes fill exactly ``x[start::stride]``."""
    if sample is None:
        return None
    m, start, stride = sample
    if not (stride >= 1 and 0 <= start < max(x.numel(), 1)):
        raise ValueError(f"Expect 0 <= `start` < N and `stride` >= 1, got {start}, {stride}.")
    want = len(range(start, x.numel(), stride))
    if m.shape != (want,) or m.dtype != x.dtype or m.device != x.device:
        raise ValueError(
            f"Expect the sampled magnitudes as a {x.dtype} vector of {want} elements on "
            f"{x.device}, got {m.dtype}, {tuple(m.shape)}, {m.device}."
        )
    return m, start, stride


# --------------------------------------------------------------------------- encode


def encode_sparse_(
    residual: torch.Tensor,
    threshold: float,
    boundary: int | None = None,
    *,
    magnitude: str = "threshold",
) -> torch.Tensor | None:
    """Sparse-encode ``residual`` in place; return the message, or None if fewer than 2 qualify.

    Every element with ``x >= t`` is sent as ``+(i+1)`` and moved by ``-t``; every element with
    ``x <= -t`` as ``-(i+1)`` and moved by ``+t``. With ``boundary`` B only the first B
    qualifying elements (ascending index) are sent and moved. When fewer than 2 elements qualify
    nothing is sent and ``residual`` is untouched (DL4J's rule).

    With ``magnitude="mean"`` the header carries m, the float32 mean of ``|x|`` over the sent
    elements (:func:`mean_magnitude`; m >= t), instead of t, and each sent element moves by m:
    a DL4J decoder adds ``±m`` per entry, exactly what left the residual.

    Args:
        residual: 1-D contiguous float tensor, changed in place.
        threshold: t > 0; rounded to float32 first, as the wire stores it.
        boundary: the most entries a message may carry, or None for no cap.
        magnitude: ``"threshold"`` (send t, DL4J's encoder) or ``"mean"`` (send m).

    Returns:
        An int32 message of ``K + 4`` words on ``residual``'s device, or None.
    """
    check_vector(residual, "residual")
    t = float32_threshold(threshold)
    check_boundary(boundary)
    mean = check_magnitude(magnitude)
    ws = thread_workspace()
    if ws.scan_(residual, None, t) < 2:
        return None
    return ws.emit_(residual, boundary, mean=mean)


def encode_dense_(residual: torch.Tensor) -> torch.Tensor:
    """Send all of a float32 ``residual``: return its dense piece and zero it.

    The piece (format ``DENSE_ENCODING = 3``, gradshare's own) is ``[N, N, 0, 3]`` followed
    by the N float32 values' bits, so decoding it adds exactly what left the residual. For
    vectors too small for a threshold message (DL4J's rule sends none with fewer than 2
    entries: a 1-element vector never sends one); a DL4J decoder does not read it.

    Raises:
        ValueError: ``residual`` is not float32 or holds a non-finite value (nothing changed).
    """
    check_vector(residual, "residual")
    if residual.dtype != torch.float32:
        raise ValueError(
            f"Expect a float32 residual for a dense piece, got {residual.dtype}: the piece "
            "carries float32 values."
        )
    bad, first = find_nonfinite(residual)
    if bad:
        raise nonfinite_error(residual, bad, first, "nothing was sent")
    n = residual.numel()
    message = torch.empty(dense_length(n), dtype=torch.int32, device=residual.device)
    message[HEADER_WORDS:].copy_(residual.view(torch.int32))
    message[:HEADER_WORDS] = torch.tensor([n, n, 0, DENSE_ENCODING], dtype=torch.int32)
    residual.zero_()
    return message


def encode_bitmap_(
    residual: torch.Tensor, threshold: float, *, magnitude: str = "threshold"
) -> torch.Tensor:
    """Bitmap-encode ``residual`` in place and return the ``N//16 + 5``-word message.

    For each element v: if ``|v| >= t`` it is sent as ``±t`` and moved toward zero by t; else if
    ``v <= -t/2`` it is sent as ``-t/2`` and ``t/2`` is added; else nothing (positive values in
    ``[t/2, t)`` stay: DL4J's asymmetry, kept so that messages match bit for bit).

    With ``magnitude="mean"`` the elements with ``|v| >= t`` are sent as ``±m`` and moved by m,
    m being the float32 mean of their ``|v|`` (:func:`mean_magnitude`), which the header
    carries; no half steps are sent (they would mean ``-m/2``).
    """
    check_vector(residual, "residual")
    t = float32_threshold(threshold)
    mean = check_magnitude(magnitude)
    return thread_workspace().bitmap_(residual, t, mean=mean)[0]


# --------------------------------------------------------------------------- decode


def _check_message(message: Any) -> list[int]:
    """The header words of ``message`` after the basic checks of its type and shape."""
    if not isinstance(message, torch.Tensor):
        raise MessageError(f"Expect a message tensor, got {type(message).__name__}.")
    if message.dtype != torch.int32 or message.dim() != 1 or not message.is_contiguous():
        raise MessageError(
            "Expect a message to be a 1-D contiguous int32 tensor, got "
            f"dtype {message.dtype} and shape {tuple(message.shape)}."
        )
    if message.numel() < HEADER_WORDS:
        raise MessageError(
            f"Expect a message of at least {HEADER_WORDS} header words, got {message.numel()}."
        )
    return read_words(message, HEADER_WORDS)


def _parse_header(header: list[int], length: int) -> tuple[int, int, float]:
    """Return (format, entries-or-N, t) after checking the header against the length."""
    first, numel, bits, fmt = header
    if fmt not in FORMAT_NAMES or fmt == COMPACT_ENCODING:  # a compact one is expanded first
        raise MessageError(
            f"Unknown format id {fmt} in word 3: expect {FLEXIBLE_ENCODING} (sparse), "
            f"{BITMAP_ENCODING} (bitmap), {COMPACT_ENCODING} (compact) or {DENSE_ENCODING} "
            "(dense)."
        )
    if fmt == DENSE_ENCODING:
        if not (first == numel >= 1 and bits == 0 and dense_length(numel) == length):
            raise MessageError(
                f"Dense header must be [N, N, 0, 3] with N + 4 words in all, got "
                f"[{first}, {numel}, {bits}, 3] in {length} words."
            )
        return fmt, first, 0.0
    t = bits_threshold(bits)
    if not (math.isfinite(t) and t > 0):
        raise MessageError(f"Expect a finite threshold > 0 in word 2, got {t!r} (bits {bits}).")
    if numel < 1:
        raise MessageError(f"Expect N >= 1 in word 1, got {numel}.")
    if fmt == FLEXIBLE_ENCODING:
        if first < 0 or sparse_length(first) != length:
            raise MessageError(
                f"Sparse header says K = {first} entries (K + 4 = {first + HEADER_WORDS} words),"
                f" but the message has {length} words."
            )
    else:
        if first != numel:
            raise MessageError(f"Bitmap header words 0 and 1 must both be N, got {first}, {numel}.")
        if bitmap_length(numel) != length:
            raise MessageError(
                f"Bitmap for N = {numel} has N//16 + 5 = {bitmap_length(numel)} words, "
                f"got {length}."
            )
    return fmt, first, t


def message_info(message: torch.Tensor) -> MessageInfo:
    """Read a message's header (and count a bitmap's entries) after checking it is well formed."""
    header = _check_message(message)
    if header[3] == COMPACT_ENCODING:
        compact_form.expand_message(message, header[1])  # validated whole
        return MessageInfo(COMPACT_ENCODING, header[0], header[1],
                           bits_threshold(header[2]), message.numel() * 4)  # fmt: skip
    fmt, first, t = _parse_header(header, message.numel())
    numel = header[1]
    if fmt == FLEXIBLE_ENCODING:
        entries = first
    elif fmt == DENSE_ENCODING:
        _check_dense(message[HEADER_WORDS:])
        entries = int(torch.count_nonzero(message[HEADER_WORDS:].view(torch.float32)))
    else:
        words = message[HEADER_WORDS:].cpu().numpy().view(np.uint32)
        sent = (words | (words >> 16)) & 0xFFFF  # one bit per element that moves
        entries = int(np.bitwise_count(sent).sum())
    return MessageInfo(fmt, entries, numel, t, message.numel() * 4)


def _fault_text(entries: Any, k: int, numel: int) -> str:
    e = int(entries[k])
    if e == 0:
        return f"entry {k} is 0; entries are ±(i+1), never 0"
    if abs(e) > numel:
        return f"entry {k} is {e}, outside ±1..±{numel} (N = {numel})"
    return (
        f"entry {k} is {e} after {int(entries[k - 1])}: entries must be strictly ascending "
        "in |index|"
    )


def _check_bitmap_tail(words: torch.Tensor, numel: int) -> None:
    used = numel % 16
    last = int(words[-1]) & 0xFFFFFFFF
    allowed = ((1 << used) - 1) | (((1 << used) - 1) << 16)
    if last & ~allowed:
        raise MessageError(
            f"Bitmap word {HEADER_WORDS + numel // 16} sets bits for elements at or past N = "
            f"{numel}: only the low {used} magnitude and sign bits may be set."
        )


def _check_dense(payload: torch.Tensor) -> None:
    values = payload.view(torch.float32)
    finite = torch.isfinite(values)
    if not bool(finite.all()):
        k = int((~finite).nonzero()[0, 0])
        raise MessageError(
            f"Dense piece holds a non-finite value at element {k} ({float(values[k])}): "
            "every value must be finite."
        )


def check_message(message: torch.Tensor, numel: int) -> None:
    """Validate ``message`` whole for a vector of ``numel`` elements, writing nothing.

    Runs every check of the message itself that :func:`decode_` runs before it writes, so a
    message that passes here decodes without error into any vector of ``numel`` elements
    whose memory it does not share. Queues that hold messages for later (``IndexedTail``) call it on
    arrival, so that a bad message is refused at the door rather than half-applied later.

    Raises:
        MessageError: naming the first fault found.
    """
    _validate(_sparse_form(message, numel), numel)


def _sparse_form(message: Any, numel: int) -> Any:
    """A compact ``message`` expanded into the sparse one it stands for (validated whole, for
    a vector of ``numel`` elements); any other as it is."""
    if (
        isinstance(message, torch.Tensor)
        and message.dtype == torch.int32
        and message.dim() == 1
        and message.numel() >= HEADER_WORDS
        and int(message[3]) == COMPACT_ENCODING
    ):
        return compact_form.expand_message(message.contiguous(), numel)
    return message


def _validate(message: Any, numel: int) -> tuple[int, float]:
    """(format, t) of ``message`` after every check for a vector of ``numel`` elements."""
    header = _check_message(message)
    fmt, _, t = _parse_header(header, message.numel())
    if header[1] != numel:
        raise MessageError(
            f"Message encodes N = {header[1]} elements, but the vector has {numel}: "
            "it was made for another vector."
        )
    payload = message[HEADER_WORDS:]
    if fmt == FLEXIBLE_ENCODING:
        k = _dispatch.first_bad_sparse(payload, numel)
        if k >= 0:
            raise MessageError("Invalid sparse message: " + _fault_text(payload, k, numel) + ".")
    elif fmt == DENSE_ENCODING:
        _check_dense(payload)
    else:
        _check_bitmap_tail(payload, numel)
    return fmt, t


def decode_(message: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Add the decoded ``message`` into ``target`` in place and return ``target``.

    The message is validated whole before any element is written: known format id, header
    consistent with the length, N equal to ``target``'s length, threshold finite and > 0, every
    sparse entry in ±1..±N, non-zero and strictly ascending, no bitmap bit past N, every value
    of a dense piece (:func:`encode_dense_`) finite. A compact message
    (:mod:`~gradshare.codec.compact_form`) is expanded, and so checked, first. Any fault
    raises :class:`MessageError` naming it and ``target`` is left bit-for-bit unchanged. So is
    a message that shares bytes with ``target`` (a view of its memory): its writes would
    change the entries being read; clone such a message first.
    Decoding never zeroes ``target``: decoding a message twice adds it twice.
    """
    check_vector(target, "target")
    check_no_overlap(message, target, "the message", "target")
    if isinstance(message, torch.Tensor) and message.device != target.device:
        raise MessageError(
            f"Expect the message and `target` on one device, got {message.device} and "
            f"{target.device}: move the message with `.to(target.device)`."
        )
    message = _sparse_form(message, target.numel())
    if _dispatch.decode_small(message, target):  # a small sparse message: checked and added
        return target
    fmt, t = _validate(message, target.numel())
    if fmt == FLEXIBLE_ENCODING:
        _dispatch.apply_sparse_(message[HEADER_WORDS:], t, target)
    elif fmt == DENSE_ENCODING:
        target.add_(message[HEADER_WORDS:].view(torch.float32))
    else:
        _dispatch.apply_bitmap_(message[HEADER_WORDS:], t, target)
    return target


def decode_sum_(
    messages: Sequence[torch.Tensor | None],
    out: torch.Tensor,
    *,
    divisor: float = 1.0,
    names: Sequence[str] | None = None,
    checked: bool = False,
) -> torch.Tensor:
    """Overwrite ``out`` with the sum of the decoded ``messages`` divided by ``divisor``.

    The same result, bit for bit, as zeroing ``out``, decoding the messages into it in order
    (None entries are skipped) and dividing by ``divisor``; on CPU it is one pass over
    ``out``, each chunk zeroed, decoded into and divided while it is in cache. Every message
    is validated whole first: on a fault :class:`MessageError` names it (by ``names[i]``,
    e.g. ``"rank 2"``, default ``"position i"``) and ``out`` is untouched; so it is when a
    message shares bytes with ``out``.

    ``checked=True`` skips that validation and the check for shared memory (not the length
    check): only for messages that this process's own encoders made, in memory of their own,
    for a vector of this length; never for messages received from elsewhere.
    """
    _dispatch.sum_(
        _present(messages, out, "out", None, divisor, names, checked), out, None, divisor
    )
    return out


def subtract_sum_(
    messages: Sequence[torch.Tensor | None],
    params: torch.Tensor,
    scratch: torch.Tensor,
    *,
    divisor: float = 1.0,
    names: Sequence[str] | None = None,
    checked: bool = False,
) -> torch.Tensor:
    """Step ``params -= (sum of the decoded messages) / divisor`` and return ``params``.

    The same result, bit for bit, as decoding the messages in order into a zeroed buffer,
    dividing it by ``divisor`` and subtracting it. ``scratch`` is a buffer like ``params``
    that holds zeros and is left holding zeros. On CPU, when every message is sparse, only
    the elements the messages name are touched, so a step costs O(entries), not O(N).
    Messages are validated whole first (unless ``checked``, as in :func:`decode_sum_`); on a
    fault ``params`` and ``scratch`` are untouched, and so they are when a message shares
    bytes with either or ``scratch`` with ``params``.
    """
    if scratch.shape != params.shape or scratch.dtype != params.dtype:
        raise ValueError(
            f"Expect `scratch` like `params` ({params.dtype}, {tuple(params.shape)}), got "
            f"{scratch.dtype}, {tuple(scratch.shape)}."
        )
    present = _present(messages, params, "params", scratch, divisor, names, checked)
    _dispatch.sum_(present, params, scratch, divisor)
    return params


def step_sum_(
    messages: Sequence[torch.Tensor | None],
    params: torch.Tensor,
    scratch: torch.Tensor,
    *,
    lr: float,
    divisor: float = 1.0,
    names: Sequence[str] | None = None,
    checked: bool = False,
) -> int:
    """Take plain SGD's step on ``params`` with the mean of the decoded ``messages`` as the
    gradient; return how many values it wrote are not finite.

    The gradient is :func:`decode_sum_`'s result (in ``scratch``'s type), and the step
    rounds as ``torch.optim.SGD`` without momentum, dampening, weight decay, nesterov or
    maximize rounds it on the CPU: ``params.add_(grad, alpha=-lr)``, one fused multiply-add
    per element. On CPU, when every message is sparse, only the elements the messages name
    are read and written (an element no message names has the gradient +0.0, which such a
    step leaves as it is), and ``scratch`` is left alone: a step of O(entries), not O(N).
    Otherwise the gradient is decoded into ``scratch`` first (it holds it after) and every
    element steps. Validation as in :func:`decode_sum_`; on a fault ``params`` and
    ``scratch`` are untouched.
    """
    if scratch.shape != params.shape:
        raise ValueError(
            f"Expect `scratch` of the shape of `params` {tuple(params.shape)}, got "
            f"{tuple(scratch.shape)}."
        )
    if not 0 <= lr <= torch.finfo(params.dtype).max:
        raise ValueError(
            f"Expect `lr` >= 0 and finite in {params.dtype}, got {lr!r}: it is SGD's "
            "learning rate, a float of the parameters' type (torch refuses it too)."
        )
    present = _present(messages, params, "params", scratch, divisor, names, checked)
    return _dispatch.step_sum_(present, params, scratch, lr, divisor)


def _present(
    messages: Sequence[torch.Tensor | None],
    target: torch.Tensor,
    target_name: str,
    scratch: torch.Tensor | None,
    divisor: float,
    names: Sequence[str] | None,
    checked: bool,
) -> list[tuple[torch.Tensor, int, float]]:
    """Every message but None, checked for ``target`` (``scratch``) and (a compact one)
    expanded, with its format and t: what the decoders take."""
    check_vector(target, target_name)
    _check_divisor(divisor)
    if names is not None and len(names) != len(messages):
        raise ValueError(
            f"Expect one name per message in `names`, got {len(names)} names for "
            f"{len(messages)} messages: a fault is reported by the name of its message."
        )
    if scratch is not None and shares_memory(scratch, target):
        raise ValueError(
            f"Expect `scratch` and `{target_name}` in separate memory, but they share bytes: "
            f"the sum is built in `scratch` while `{target_name}` is written. Pass a buffer of "
            f"its own, e.g. `torch.zeros_like({target_name})`."
        )
    numel = target.numel()
    present: list[tuple[torch.Tensor, int, float]] = []
    for i, m in enumerate(messages):
        if m is None:
            continue
        name = f"position {i}" if names is None else names[i]
        if checked:  # made here, in memory of its own, for a vector of this length: confirm N
            _, n, bits, fmt = read_words(m, HEADER_WORDS)
            if n != numel:
                raise MessageError(
                    f"Message from {name} encodes N = {n} elements, but the target has "
                    f"{numel}: it was made for another vector."
                )
            if fmt == COMPACT_ENCODING:
                m, fmt = compact_form.expand_message(m, numel), FLEXIBLE_ENCODING
            present.append((m, fmt, bits_threshold(bits)))
            continue
        check_no_overlap(m, target, f"the message from {name}", target_name)
        if scratch is not None:
            check_no_overlap(m, scratch, f"the message from {name}", "scratch")
        try:
            if isinstance(m, torch.Tensor) and m.device != target.device:
                raise MessageError(f"it is on {m.device}, the target on {target.device}")
            m = _sparse_form(m, numel)
            fmt, t = _validate(m, numel)
        except MessageError as e:
            raise MessageError(f"Message from {name} is invalid: {e}") from None
        present.append((m, fmt, t))
    return present


def _check_divisor(divisor: Any) -> None:
    """Raise ValueError unless ``divisor`` is a normal float32 > 0 (so is its reciprocal)."""
    if type(divisor) is int and 1 <= divisor <= 1 << 24:  # a count of parties or ranks
        return
    ok = isinstance(divisor, (int, float))
    if ok:
        try:
            d = F32.unpack(F32.pack(divisor))[0]
        except OverflowError:
            d = math.inf
        ok = F32_TINY <= d <= F32_MAX
    if not ok:
        raise ValueError(
            f"Expect `divisor` finite and > 0 as a normal float32 (between 1.2e-38 and "
            f"3.4e38), got {divisor!r}: the sum is divided by it in float32, where a smaller "
            "value rounds to 0 or has no finite reciprocal and a larger one rounds to inf."
        )
