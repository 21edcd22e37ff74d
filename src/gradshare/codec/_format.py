"""The wire format's layout (private): format ids, header words, lengths, the float32 in word 2.

:mod:`gradshare.codec` re-exports the public names; they live here so that the layers below the
codec (:mod:`gradshare.codec._workspace`, :mod:`gradshare.codec._dispatch`,
:mod:`gradshare.codec._torch_paths`) can build headers without importing it. See the codec's
docstring and docs/design.md §1.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

FLEXIBLE_ENCODING = 0
"""Format id of a sparse message (signed 1-based indices)."""
BITMAP_ENCODING = 1
"""Format id of a bitmap message (2 bits per element)."""
COMPACT_ENCODING = 2
"""Format id of a compact sparse message (the gaps' Rice code; gradshare's option, not DL4J's)."""
DENSE_ENCODING = 3
"""Format id of a dense piece: the float32 values themselves (gradshare's own, not DL4J's),
for a vector too small for a threshold message to carry it."""
COMPACT_MAX_R = 30
"""The most low bits per gap in a compact message (its byte 0): gaps reach 2^31."""
HEADER_WORDS = 4
MAX_NUMEL = 2**31 - 1
"""Largest N a message can address: indices are signed int32 ``±(i+1)``."""
FORMAT_NAMES = {
    FLEXIBLE_ENCODING: "sparse",
    BITMAP_ENCODING: "bitmap",
    COMPACT_ENCODING: "compact",
    DENSE_ENCODING: "dense",
}

F32 = struct.Struct("<f")
I32 = struct.Struct("<i")
F32_TINY = float(np.finfo(np.float32).tiny)
F32_MAX = float(np.finfo(np.float32).max)


class MessageError(ValueError):
    """A message that is not a valid gradshare/DL4J message for its target."""


def sparse_length(num_entries: int) -> int:
    """Words in a sparse message of ``num_entries`` entries: K + 4."""
    return num_entries + HEADER_WORDS


def dense_length(numel: int) -> int:
    """Words in a dense piece for N elements: N + 4."""
    return numel + HEADER_WORDS


def bitmap_length(numel: int) -> int:
    """Words in a bitmap message for N elements: N//16 + 5."""
    return numel // 16 + 1 + HEADER_WORDS


def threshold_bits(t: float) -> int:
    """The int32 reading of ``t``'s float32 bits (t already float32-representable)."""
    return int(I32.unpack(F32.pack(t))[0])


def bits_threshold(bits: int) -> float:
    """The float32 that the int32 ``bits`` of word 2 hold."""
    return float(F32.unpack(I32.pack(bits))[0])


def read_words(message: torch.Tensor, count: int) -> list[int]:
    """The first ``count`` words of ``message`` as Python ints (on any device)."""
    if message.device.type == "cpu":
        return message.numpy()[:count].tolist()
    return [int(v) for v in message[:count].tolist()]


def write_header(message: torch.Tensor, first: int, numel: int, t: float, fmt: int) -> None:
    """Write the 4 header words ``[first, numel, bits of t, fmt]`` into ``message``."""
    write_words(message, [first, numel, threshold_bits(t), fmt])


def write_words(message: torch.Tensor, words: list[int]) -> None:
    """Write ``words`` into the first words of ``message`` (on any device)."""
    if message.device.type == "cpu":
        message.numpy()[: len(words)] = words
    else:
        message[: len(words)] = torch.tensor(words, dtype=torch.int32)


# --------------------------------------------------------------------------- mean magnitude

MAGNITUDES = ("threshold", "mean")
"""What a message's header float holds: t, or the mean magnitude of the sent elements."""
NBINS = 280
"""Exponent bins of :func:`mean_magnitude` (``_kernels.NBINS``, without importing numba)."""


def mean_magnitude(bins: np.ndarray, count: int) -> float:
    """The float32 mean of ``count`` magnitudes given by their exponent ``bins``.

    Each magnitude ``|x|`` is taken as a float32 (inf and values past the float32 range as
    the largest float32); it equals ``q * 2**(e - 24)`` with ``(q, e) = frexp`` and
    ``bins[e + 149]`` holds the int64 sum of its ``q``. So the sum is exact, in any order and
    on any device; the mean is that sum divided by ``count``, rounded to float64 and then to
    float32. Every magnitude is >= t, and so is the mean.
    """
    total = 0
    for k in np.flatnonzero(bins).tolist():
        total += int(bins[k]) << k
    mean = total / (count << (149 + 24))  # exact int division, correctly rounded
    return float(F32.unpack(F32.pack(min(mean, F32_MAX)))[0])
