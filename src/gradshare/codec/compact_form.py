"""The compact form of a sparse message: about 7.1 bits per entry instead of 32 (an option).

A DL4J sparse message spends a 32-bit word per entry: the signed 1-based index. Its indices
ascend, so the gaps between them are small (25 on average at 4 % density): the compact form
(format id ``COMPACT_ENCODING = 2``) holds the same entries as the gaps' Rice code, its three
parts each in a stream of its own:

- words 0-3: the sparse header with format 2, ``[K, N, bits of t, 2]``; word 4: L, the
  payload's bytes;
- then L bytes, little-endian in ``ceil(L/4)`` words, the last word's spare bytes zero. Each
  entry's gap g >= 1 from the previous entry's index (the first entry's from -1) is split as
  ``g - 1 = q·2^r + low``. Bits are read from each byte's bit 0 up:

  - byte 0: r, 0 to :data:`~gradshare.codec._format.COMPACT_MAX_R`;
  - the signs: ``ceil(K/8)`` bytes, bit j set where entry j is -t;
  - the low parts: ``ceil(K·r/8)`` bytes, entry j's r bits from bit j·r;
  - the high parts, the rest (at least one byte): for each entry, q zero bits and a one.

  Every spare bit is zero, so the last byte holds the K-th one. Gaps 1, 5, 20 with r = 2 are
  low parts 0, 0, 3 and high parts 0, 1, 4: the bits ``1``, ``01``, ``00001``.

That is r + 2 bits per entry plus one per 2^r elements of its gap: the encoder takes the least r
that makes L least, about 7.1 bits at 4 % uniform density (the gaps' entropy and sign are
7.06), 8.5 at 1.56 %; SparseLoCo's chunk-relative indices with 2-bit values take 14, DL4J's
32. :func:`compact_message` keeps the sparse message when the compact one would not be
shorter, so a compact message is never longer than the sparse message it stands for (the
exchange's caps hold) and :func:`expand_message` refuses one that is.

The form is lossless: expanding gives the sparse message back word for word, so decoding, the
residuals and the replicas are bit for bit those of DL4J's messages; only the bytes on the wire
change. Bitmap messages stay as they are. :func:`~gradshare.codec.decode_`,
:func:`~gradshare.codec.decode_sum_`, :func:`~gradshare.codec.check_message` and
:func:`~gradshare.codec.message_info` read both forms; a DL4J decoder reads only DL4J's.

Example::

    >>> import torch
    >>> from gradshare.codec import compact_message, encode_sparse_, expand_message
    >>> residual = torch.zeros(1000)
    >>> residual[[3, 10, 11, 12, 13, 14, 500]] = torch.tensor([1.0, -1, 1, 1, 1, 1, 1])
    >>> sparse = encode_sparse_(residual, 0.5)
    >>> sparse.tolist()
    [7, 1000, 1056964608, 0, 4, -11, 12, 13, 14, 15, 501]
    >>> small = compact_message(sparse)  # gaps 4, 7, 1, 1, 1, 1, 486: r = 5; signs 2
    >>> small.tolist()  # (entry 1 is -t); low parts 3, 6, 0, 0, 0, 0, 5; high parts 0 (x6), 15
    [7, 1000, 1056964608, 2, 10, 12780037, 1057046528, 8192]
    >>> torch.equal(expand_message(small, 1000), sparse)
    True
"""

from __future__ import annotations

import math

import torch

from gradshare.codec import _dispatch
from gradshare.codec._format import (
    COMPACT_ENCODING,
    FLEXIBLE_ENCODING,
    HEADER_WORDS,
    MessageError,
    bits_threshold,
    read_words,
    write_words,
)

__all__ = ["COMPACT_HEADER_WORDS", "compact_length", "compact_message", "expand_message"]

COMPACT_HEADER_WORDS = HEADER_WORDS + 1
"""The sparse header's 4 words and L, the payload's bytes."""


def compact_length(num_bytes: int) -> int:
    """Words in a compact message of ``num_bytes`` payload bytes: 5 + ceil(L/4)."""
    return COMPACT_HEADER_WORDS + (num_bytes + 3) // 4


def compact_message(message: torch.Tensor) -> torch.Tensor:
    """The compact form of a sparse ``message`` made by this process, or ``message`` itself
    when that form would not be shorter (a bitmap, fewer than 3 entries, or gaps too long).

    ``message`` is trusted (an encoder's own, valid for its vector): it is not validated.
    """
    if message.numel() <= HEADER_WORDS:
        return message
    k, n, bits, fmt = read_words(message, HEADER_WORDS)
    limit = 4 * (k - 2)  # the most bytes with 5 + ceil(L/4) < K + 4 words
    if fmt != FLEXIBLE_ENCODING or limit < 3:  # r, a byte of signs, a byte of high parts
        return message
    out = torch.zeros(k + HEADER_WORDS, dtype=torch.int32, device=message.device)
    num_bytes = _dispatch.compact_entries(
        message[HEADER_WORDS:], out[COMPACT_HEADER_WORDS:].view(torch.uint8), limit
    )
    if num_bytes < 0:
        return message
    write_words(out, [k, n, bits, COMPACT_ENCODING, num_bytes])
    return out[: compact_length(num_bytes)]


def expand_message(message: torch.Tensor, numel: int) -> torch.Tensor:
    """The sparse message that compact ``message`` stands for, for a vector of ``numel``
    elements, after validating it whole.

    Raises:
        MessageError: naming the first fault (header against length, N, t, L, a message
            longer than its sparse form, spare bytes set, r past its range, too few bytes
            for K entries' signs and low parts, spare bits set, a last byte of zero, a count
            of high parts other than K, an index past N). So the sparse message it returns
            is valid: its indices strictly ascend in 1..N.
    """

    def fault(text: str) -> MessageError:
        return MessageError(f"Invalid compact message: {text}.")

    length = message.numel()
    if length < COMPACT_HEADER_WORDS:
        raise fault(f"it has {length} words, fewer than its {COMPACT_HEADER_WORDS} header words")
    k, n, bits, fmt, num_bytes = read_words(message, COMPACT_HEADER_WORDS)
    if fmt != COMPACT_ENCODING:
        raise fault(f"word 3 is format {fmt}, not {COMPACT_ENCODING}")
    t = bits_threshold(bits)
    if not (math.isfinite(t) and t > 0):
        raise fault(f"expect a finite threshold > 0 in word 2, got {t!r} (bits {bits})")
    if n != numel:
        raise fault(f"it encodes N = {n} elements, but the vector has {numel}")
    if k < 1 or not 2 <= num_bytes <= 4 * length:
        raise fault(f"K = {k} entries in L = {num_bytes} bytes: expect K >= 1 and L >= 2")
    if compact_length(num_bytes) != length:
        raise fault(
            f"L = {num_bytes} bytes take 5 + ceil(L/4) = {compact_length(num_bytes)} words, "
            f"but the message has {length}"
        )
    if length >= k + HEADER_WORDS:
        raise fault(
            f"its {length} words are no fewer than the {k + HEADER_WORDS} of the sparse message "
            "it stands for (the sparse one is sent then)"
        )
    payload = message[COMPACT_HEADER_WORDS:].view(torch.uint8)
    spare = payload[num_bytes:]
    if bool(spare.numpy().any() if spare.is_cpu else spare.any()):
        raise fault(f"bytes past L = {num_bytes} are set; they must be zero")
    out = torch.empty(k + HEADER_WORDS, dtype=torch.int32, device=message.device)
    entries = _dispatch.expand_entries(payload[:num_bytes], k, numel, out[HEADER_WORDS:])
    if isinstance(entries, str):
        raise fault(entries)
    write_words(out, [k, n, bits, FLEXIBLE_ENCODING])
    return out
