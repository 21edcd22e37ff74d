"""Messages of several vectors sent as one: one DL4J message per vector, back to back.

The DDP hook sends one message per bucket and rank made of one piece per parameter, and
:class:`~gradshare.LocalSteps` one per sync and rank made of one piece per parameter tensor.
Every piece is a whole DL4J message for its own vector (docs/design.md §1); a vector that
sends nothing in a multipart message that carries others puts an empty sparse header
``[0, N, bits(t), 0]``. A sparse piece may travel in its compact form
(:mod:`~gradshare.codec.compact_form`, when the sender opts in), and a vector too small for a
threshold message as a dense piece (:func:`~gradshare.codec.encode_dense_`). A receiver cuts
the pieces by their headers and validates every one whole before anything is decoded; a compact
piece comes back as the sparse message it stands for.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import torch

from gradshare.codec._format import (
    BITMAP_ENCODING,
    COMPACT_ENCODING,
    DENSE_ENCODING,
    FLEXIBLE_ENCODING,
    HEADER_WORDS,
    bitmap_length,
    dense_length,
    sparse_length,
)
from gradshare.codec.compact_form import COMPACT_HEADER_WORDS, compact_length, expand_message
from gradshare.codec.messages import MessageError, check_message

__all__ = ["empty_message", "join_messages", "split_message"]

_F32, _I32 = struct.Struct("<f"), struct.Struct("<i")


def empty_message(numel: int, t: float, device: torch.device) -> torch.Tensor:
    """A sparse message of no entries for ``numel`` elements: ``[0, N, bits(t), 0]``."""
    bits = _I32.unpack(_F32.pack(t))[0]
    header = [0, numel, bits, FLEXIBLE_ENCODING]
    return torch.tensor(header, dtype=torch.int32, device=device)


def join_messages(
    messages: Sequence[torch.Tensor | None],
    sizes: Sequence[int],
    thresholds: Sequence[float],
    device: torch.device,
) -> torch.Tensor | None:
    """One message of every vector's piece, in order (None when no vector sends anything).

    ``messages[i]`` is vector i's message or None; ``sizes[i]`` its elements and
    ``thresholds[i]`` the threshold its empty header carries when it sends nothing.
    """
    if all(message is None for message in messages):
        return None
    return torch.cat([
        empty_message(n, t, device) if message is None else message
        for message, n, t in zip(messages, sizes, thresholds, strict=True)
    ])  # fmt: skip


def split_message(
    message: torch.Tensor | None, sizes: Sequence[int], name: str, labels: Sequence[Any]
) -> list[torch.Tensor | None]:
    """Cut ``name``'s multipart message into one piece per vector by the pieces' headers and
    validate each whole; None for a vector that sent nothing, and a compact piece's sparse
    message. ``labels[i]`` names vector i in errors.

    Raises:
        MessageError: a piece is invalid for its vector, runs past the message's end, or
            words are left over, naming ``name`` and the vector.
    """
    if message is None:
        return [None] * len(sizes)
    if message.dtype != torch.int32 or message.dim() != 1:
        raise MessageError(f"Message from {name} is not a 1-D int32 tensor.")
    words = message.cpu().numpy()  # the headers are read here (no copy on CPU)
    length = len(words)
    pieces: list[torch.Tensor | None] = []
    pos = 0
    for label, n in zip(labels, sizes, strict=True):
        where = f"Message from {name}, piece of parameter {label} ({n} elements) at word {pos}"
        if pos + HEADER_WORDS > length:
            raise MessageError(
                f"{where}: the message ends at word {length}, before this piece's header; it "
                "holds fewer pieces than there are parameters."
            )
        first, _, _, fmt = (int(w) for w in words[pos : pos + HEADER_WORDS])
        if fmt == BITMAP_ENCODING:
            size = bitmap_length(n)
        elif fmt == FLEXIBLE_ENCODING and first >= 0:
            size = sparse_length(first)
        elif fmt == DENSE_ENCODING:
            size = dense_length(n)
        elif fmt == COMPACT_ENCODING and pos + COMPACT_HEADER_WORDS <= length:
            size = compact_length(max(int(words[pos + HEADER_WORDS]), 0))
        else:
            size = HEADER_WORDS  # check_message names the fault
        if pos + size > length:
            raise MessageError(
                f"{where}: the piece's header says {size} words, past the message's end at "
                f"word {length}."
            )
        piece = message[pos : pos + size]
        try:
            if fmt == COMPACT_ENCODING:
                piece = expand_message(piece, n)
            else:
                check_message(piece, n)
        except MessageError as e:
            raise MessageError(f"{where} is invalid: {e}") from None
        pieces.append(None if fmt == FLEXIBLE_ENCODING and first == 0 else piece)
        pos += size
    if pos != length:
        raise MessageError(
            f"Message from {name} has {length - pos} word(s) left over after the pieces of "
            f"its {len(sizes)} parameters (which end at word {pos})."
        )
    return pieces
