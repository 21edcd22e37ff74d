"""One flat vector for many tensors: the slice of it that holds each one (private)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

__all__ = ["views"]


def views(
    flat: torch.Tensor, tensors: Iterable[torch.Tensor]
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each of ``tensors`` with the slice of ``flat`` that holds it, shaped like it, laid out
    one after the other from element 0 in order (``flat`` must hold at least their sum)."""
    offset = 0
    for t in tensors:
        n = t.numel()
        yield t, flat[offset : offset + n].view_as(t)
        offset += n
