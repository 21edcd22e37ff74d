"""One flat vector for many tensors: the slice of it that holds each one."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

__all__ = ["slices", "views"]


def slices(flat: torch.Tensor, sizes: Iterable[int]) -> Iterator[torch.Tensor]:
    """Consecutive 1-D slices of ``flat`` of ``sizes`` elements each, from element 0 on
    (``flat`` must hold at least their sum)."""
    offset = 0
    for n in sizes:
        yield flat[offset : offset + n]
        offset += n


def views(
    flat: torch.Tensor, tensors: Iterable[torch.Tensor]
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each of ``tensors`` with the slice of ``flat`` that holds it, shaped like it, laid out
    one after the other from element 0 in order (``flat`` must hold at least their sum)."""
    tensors = list(tensors)
    for t, piece in zip(tensors, slices(flat, (t.numel() for t in tensors)), strict=True):
        yield t, piece.view_as(t)
