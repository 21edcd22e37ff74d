"""The hierarchical exchange: which ranks share a machine, the exchange in two levels
(:class:`HierarchicalExchange`), and how a node's leader hands the messages of all nodes to
the other ranks of its node (docs/design.md §6).

A node is a run of ``node_size`` consecutive ranks, as torchrun numbers them (rank =
node rank x ``LOCAL_WORLD_SIZE`` + ``LOCAL_RANK``); its first rank is its leader. Over
torch.distributed only int64 headers and int32 messages travel, as in
:func:`gradshare.distributed.exchange.exchange_messages`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradshare import codec
from gradshare.distributed.exchange import (
    ExchangeError,
    PrivateGroup,
    collective,
    exchange_messages,
    largest_message,
    take_back,
)
from gradshare.encoding.encoder import Encoder

__all__ = ["HierarchicalExchange", "NodeLayout", "broadcast_messages", "node_layout"]

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
    hierarchical: bool | int,
    group: dist.ProcessGroup | None,
    private: dist.ProcessGroup,
    timeout: timedelta,
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
    collective(
        dist.all_gather,
        table,
        mine,
        group=private,
        timeout=timeout,
        what="node layout exchange",
        rank=rank,
    )
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
    node_ranks, rail_ranks = ranks[node * size : (node + 1) * size], ranks[rank % size :: size]
    return NodeLayout(size, world // size, node, node_ranks, rail_ranks)


def broadcast_messages(
    messages: list[torch.Tensor | None] | None,
    *,
    src: int,
    group: dist.ProcessGroup | None,
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
    collective(
        dist.broadcast,
        header,
        src=src,
        group=group,
        timeout=timeout,
        what="node broadcast of the sizes",
        rank=rank,
    )
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
        raise ExchangeError(
            f"Rank {rank}: the node leader (rank {src}) sent sizes {sizes}, "
            f"but no valid message is longer than {cap} words."
        )
    total = sum(sizes)
    if total == 0:
        return [None] * num_nodes
    if rank == src:
        assert messages is not None
        payload = torch.cat([m for m in messages if m is not None]).to(device)
    else:
        payload = torch.empty(total, dtype=torch.int32, device=device)
    collective(
        dist.broadcast,
        payload,
        src=src,
        group=group,
        timeout=timeout,
        what="node broadcast of the messages",
        rank=rank,
    )
    out: list[torch.Tensor | None] = []
    start = 0
    for s in sizes:
        out.append(payload[start : start + s] if s else None)
        start += s
    return out


class HierarchicalExchange:
    """The two-level exchange of :class:`~gradshare.SharedOptimizer` (``hierarchical=``).

    Each step: the ranks of a node all-reduce their updates densely (sum); every rank of the
    node adds that node update into the node's residual with an identical encoder, so every
    rank of a node holds the same node residual; the node leaders exchange their encoded
    messages across nodes; each leader broadcasts them to its node, where every rank validates
    and applies them in node order. A failure anywhere reaches every rank: a leader tells the
    other leaders, and its node through the broadcast.

    Making it is a collective of every rank: each makes its node's group, then its rail's.
    """

    def __init__(
        self, layout: NodeLayout, numel: int, timeout: timedelta, device: torch.device
    ) -> None:
        self.layout = layout
        self.numel = numel
        self.timeout = timeout
        self.device = device
        self._node = PrivateGroup(None, timeout, layout.node_ranks)
        self._leaders = PrivateGroup(None, timeout, layout.rail_ranks)
        """For the leaders, the leaders' group (for the others their rail's, unused)."""
        self._node.get()  # every rank makes both now, in this order (see rail_ranks)
        self._leaders.get()

    def share(
        self,
        update: torch.Tensor,
        before: torch.Tensor,
        scratch: torch.Tensor,
        encoder: Encoder,
        failure: BaseException | None,
        *,
        iteration: int,
        divisor: int,
        sent: Callable[[int], None],
    ) -> None:
        """All-reduce this node's ``update`` (in place), encode it into the node residual,
        exchange the node messages between leaders, broadcast them in the node, and step
        ``before -= Σ decoded / divisor``; ``sent(bytes)`` counts what a leader sent. On any
        error this rank's message goes back into the residual."""
        nodes = self.layout
        rank = dist.get_rank()
        leader = rank == nodes.leader
        kw: dict[str, Any] = {"timeout": self.timeout, "device": self.device}
        try:  # 1. every rank of the node is well, then U = Σ of the node's updates
            node = self._node.get()
            exchange_messages(None, self.numel, group=node, failure=failure, round=iteration, **kw)
            collective(
                dist.all_reduce,
                update,
                group=node,
                timeout=self.timeout,
                what="node all-reduce",
                rank=rank,
            )
        except BaseException as e:
            if leader:
                self._tell_leaders(e)
            raise
        message: torch.Tensor | None = None
        failure = None
        try:  # 2. the same residual, U and threshold give the same message on every rank
            message = encoder.encode(update, iteration)
        except Exception as e:
            failure = e
        try:  # 3. leaders exchange across nodes, then hand the messages to their node
            if leader:
                try:
                    gathered = exchange_messages(
                        message,
                        self.numel,
                        group=self._leaders.get(),
                        failure=failure,
                        round=iteration,
                        **kw,
                    )
                except BaseException:
                    if failure is None:  # the others of the node wait for the broadcast
                        broadcast_messages(
                            None,
                            src=rank,
                            group=self._node.get(),
                            num_nodes=nodes.num_nodes,
                            numel=self.numel,
                            **kw,
                        )
                    raise
                sent(0 if message is None else message.numel() * 4)
            elif failure is not None:
                raise failure  # the leader failed alike (same residual, same U)
            else:
                gathered = None
            messages = broadcast_messages(
                gathered if leader else None,
                src=nodes.leader,
                group=self._node.get(),
                num_nodes=nodes.num_nodes,
                numel=self.numel,
                **kw,
            )
            codec.subtract_sum_(
                messages,
                before,
                scratch,
                divisor=divisor,
                names=[f"node {k}" for k in range(nodes.num_nodes)],
            )
        except BaseException:
            if message is not None:
                take_back(message, encoder.residual)  # type: ignore[arg-type]
            raise

    def _tell_leaders(self, error: BaseException) -> None:
        """This node failed before its exchange: let the other leaders raise at once too."""
        with contextlib.suppress(BaseException):
            exchange_messages(
                None,
                self.numel,
                group=self._leaders.get(),
                timeout=self.timeout,
                device=self.device,
                failure=error,
            )
