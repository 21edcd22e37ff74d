"""The nodes of the hierarchical exchange: which ranks share a machine, and how a node's
leader hands the messages of all nodes to the other ranks of its node (docs/design.md §6).

A node is a run of ``node_size`` consecutive ranks, as torchrun numbers them (rank =
node rank x ``LOCAL_WORLD_SIZE`` + ``LOCAL_RANK``); its first rank is its leader. Over
torch.distributed only int64 headers and int32 messages travel, as in
:func:`gradshare.distributed.exchange.exchange_messages`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradshare.distributed.exchange import ExchangeError, collective, largest_message

__all__ = ["NodeLayout", "broadcast_messages", "node_layout"]

_OK, _FAILED = 0, 1


@dataclass(frozen=True, slots=True)
class NodeLayout:
    """Where this rank sits: ``num_nodes`` nodes of ``node_size`` consecutive ranks."""

    node_size: int
    num_nodes: int
    node: int
    """This rank's node (0-based)."""
    node_ranks: list[int]
    """The global ranks of this rank's node; the first is its leader."""
    rail_ranks: list[int]
    """The global ranks of every node's rank at this rank's place in its node, in node order:
    for the leaders, the leaders (who exchange across nodes). The others make their rail's
    group too, unused, so that every rank holds as many groups: torch names a group made
    with ``use_local_synchronization`` after its ranks and the count of groups the rank
    holds, so ranks holding different counts could not make a group together again."""

    @property
    def leader(self) -> int:
        return self.node_ranks[0]


def node_layout(
    hierarchical: bool | int, group: Any, private: Any, timeout: timedelta
) -> NodeLayout | None:
    """Resolve ``SharedOptimizer(hierarchical=...)``: None for the flat exchange.

    ``True`` takes the ranks per node from ``LOCAL_WORLD_SIZE`` (torchrun sets it), an int
    gives them. A collective over ``private`` (a twin of ``group``): every rank shows its
    node size, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``, so that every rank refuses alike (a
    rank that refused alone would leave the others waiting) when the sizes differ, do not
    divide the world, a given size disagrees with ``LOCAL_WORLD_SIZE``, or ``LOCAL_RANK``
    shows that the ranks of a node are not consecutive.
    """
    if hierarchical is False:
        return None
    if not isinstance(hierarchical, int) or (hierarchical is not True and hierarchical < 1):
        raise ValueError(
            f"Expect `hierarchical` True (ranks per node from LOCAL_WORLD_SIZE) or a number "
            f"of ranks per node >= 1, got {hierarchical!r}."
        )
    raw = os.environ.get("LOCAL_WORLD_SIZE", "")
    size = hierarchical if hierarchical is not True else (int(raw) if raw.isdigit() else 0)
    local = os.environ.get("LOCAL_RANK", "")
    mine = torch.tensor(
        [size, int(local) if local.isdigit() else -1, int(raw) if raw.isdigit() else -1],
        dtype=torch.int64,
    )
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    table = [torch.empty_like(mine) for _ in range(world)]
    collective(dist.all_gather, table, mine, group=private, timeout=timeout,
               what="node layout exchange", rank=rank)  # fmt: skip
    sizes = [int(t[0]) for t in table]
    if 0 in sizes:
        raise ValueError(
            f"`hierarchical=True` takes the ranks per node from LOCAL_WORLD_SIZE, which is not "
            f"set on rank(s) {[r for r, s in enumerate(sizes) if s == 0]}: launch with "
            "torchrun, or pass the number of ranks per node (e.g. `hierarchical=2`)."
        )
    if len(set(sizes)) != 1:
        raise ValueError(f"Expect every rank to give the same ranks per node, got {sizes}.")
    if world % size:
        raise ValueError(
            f"Expect the world to be a whole number of equal nodes: {world} ranks do not split "
            f"into nodes of {size} (`hierarchical={hierarchical!r}`)."
        )
    launched = [int(t[2]) for t in table]
    if hierarchical is not True and any(n >= 0 and n != size for n in launched):
        r = next(r for r, n in enumerate(launched) if n >= 0 and n != size)
        raise ValueError(
            f"`hierarchical={hierarchical!r}` disagrees with LOCAL_WORLD_SIZE={launched[r]} "
            f"(rank {r}): the launcher put {launched[r]} ranks on a machine; pass "
            f"`hierarchical=True` (or {launched[r]}), or launch {size} ranks per machine."
        )
    locals_ = [int(t[1]) for t in table]
    wrong = [r for r, lr in enumerate(locals_) if lr >= 0 and lr != r % size]
    if wrong:
        r = wrong[0]
        raise ValueError(
            f"Expect the ranks of a node to be consecutive (rank = node x {size} + LOCAL_RANK, "
            f"as torchrun numbers them), but rank {r} has LOCAL_RANK {locals_[r]}: launch "
            "every node with the same --nproc_per_node."
        )
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    node = rank // size
    return NodeLayout(size, world // size, node, ranks[node * size : (node + 1) * size],
                      ranks[rank % size :: size])  # fmt: skip


def broadcast_messages(
    messages: list[torch.Tensor | None] | None,
    *,
    src: int,
    group: Any,
    num_nodes: int,
    numel: int,
    timeout: timedelta,
    device: torch.device,
) -> list[torch.Tensor | None]:
    """Hand the leader's gathered ``messages`` (one per node) to every rank of its node.

    The leader (global rank ``src``) passes the list, or None when its exchange across nodes
    failed: then the others raise :class:`ExchangeError` and the leader gets ``[]`` (it raises
    its own error). Sizes travel first (int64), then the messages as one int32 payload.
    """
    rank = dist.get_rank()
    header = torch.zeros(2 + num_nodes, dtype=torch.int64, device=device)
    if rank == src:
        header[0] = _FAILED if messages is None else _OK
        if messages is not None:
            header[2:] = torch.tensor([0 if m is None else m.numel() for m in messages])
    collective(dist.broadcast, header, src=src, group=group, timeout=timeout,
               what="node broadcast of the sizes", rank=rank)  # fmt: skip
    status, _, *sizes = header.cpu().tolist()
    if status != _OK:
        if rank == src:
            return []
        raise ExchangeError(
            f"Rank {rank}: the exchange across nodes failed on this node's leader (rank {src}); "
            "see its error. Every rank stops here."
        )
    cap = largest_message(numel)
    if not all(0 <= s <= cap for s in sizes):
        raise ExchangeError(f"Rank {rank}: the node leader (rank {src}) sent sizes {sizes}, "
                            f"but no valid message is longer than {cap} words.")  # fmt: skip
    total = sum(sizes)
    if total == 0:
        return [None] * num_nodes
    if rank == src:
        assert messages is not None
        payload = torch.cat([m for m in messages if m is not None]).to(device)
    else:
        payload = torch.empty(total, dtype=torch.int32, device=device)
    collective(dist.broadcast, payload, src=src, group=group, timeout=timeout,
               what="node broadcast of the messages", rank=rank)  # fmt: skip
    out: list[torch.Tensor | None] = []
    start = 0
    for s in sizes:
        out.append(payload[start : start + s] if s else None)
        start += s
    return out
