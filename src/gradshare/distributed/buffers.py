"""A model's buffers made alike on every rank: rank 0's, sent only where they differ.

Parameters stay alike because every rank applies the same decoded step; buffers (BatchNorm's
running statistics, counters, masks) are written by each replica's own forward passes and
drift apart. ``DistributedDataParallel`` broadcasts rank 0's buffers before every forward
(``broadcast_buffers=True``); :class:`BufferSync` does the same at each sync of
:class:`~gradshare.LocalSteps` or step of :class:`~gradshare.SharedOptimizer`, but first
compares a CRC-32 of each buffer across the ranks, so a buffer that no rank changed (a causal
mask, a rotary table) costs 8 bytes a sync, not its size.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from gradshare.distributed.exchange import GroupSource, collective, this_rank

__all__ = ["BufferSync"]


class BufferSync:
    """Make ``module``'s buffers rank 0's on every rank, sending only those that differ.

    Every rank of ``group`` calls :meth:`sync` (or :meth:`digests`, then :meth:`take` with
    every rank's digests, where the caller exchanges them with its own) at the same points.

    Args:
        module: the model whose ``buffers()`` (persistent or not) are synced.
        group: the private group the collectives run on (its timeout bounds them).
        device: where the collectives run (the model's device; CUDA under NCCL).
    """

    __slots__ = ("buffers", "device", "group", "names", "sent")

    def __init__(self, module: torch.nn.Module, group: GroupSource, device: torch.device) -> None:
        named = list(module.named_buffers())
        self.names = [n for n, _ in named]
        self.buffers = [b for _, b in named]
        self.group = group
        self.device = device
        self.sent = 0
        """Bytes broadcast so far (by rank 0; received by the others)."""

    def __len__(self) -> int:
        return len(self.buffers)

    def layout(self) -> list[tuple[str, list[int], str]]:
        """Each buffer's name, shape and dtype: what every rank must agree on."""
        return [
            (n, list(b.shape), str(b.dtype)) for n, b in zip(self.names, self.buffers, strict=True)
        ]

    def digests(self) -> list[int]:
        """The CRC-32 of each buffer's bytes (as they are on this rank)."""
        out = []
        for b in self.buffers:
            raw = b.detach().reshape(-1).cpu().contiguous()
            out.append(zlib.crc32(raw.view(torch.uint8).numpy().data) if raw.numel() else 0)
        return out

    @torch.no_grad()
    def take(self, table: list[list[int]]) -> int:
        """Given every rank's :meth:`digests` (``table[r]``, in group rank order), broadcast
        rank 0's buffers wherever a rank's digest differs from rank 0's, one broadcast per
        dtype (a collective, the same on every rank). Returns the bytes broadcast."""
        differ = [
            i for i in range(len(self.buffers)) if any(row[i] != table[0][i] for row in table)
        ]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for i in differ:
            by_dtype.setdefault(self.buffers[i].dtype, []).append(self.buffers[i])
        group = self.group.get()
        sent = 0
        for buffers in by_dtype.values():
            flat = torch.cat([b.detach().reshape(-1) for b in buffers]).to(self.device)
            collective(
                dist.broadcast,
                flat,
                group_src=0,
                group=group,
                timeout=self.group.timeout,
                what="buffer broadcast",
                rank=this_rank(group),
            )
            pos = 0
            for b in buffers:
                b.copy_(flat[pos : pos + b.numel()].view_as(b))
                pos += b.numel()
            sent += flat.numel() * flat.element_size()
        self.sent += sent
        return sent

    def sync(self) -> int:
        """Gather every rank's digests, then :meth:`take` (two collectives at most; none
        without buffers). Returns the bytes broadcast."""
        if not self.buffers:
            return 0
        group = self.group.get()
        mine = torch.tensor(self.digests(), dtype=torch.int64, device=self.device)
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        collective(
            dist.all_gather,
            rows,
            mine,
            group=group,
            timeout=self.group.timeout,
            what="buffer digests",
            rank=this_rank(group),
        )
        return self.take([row.tolist() for row in rows])
