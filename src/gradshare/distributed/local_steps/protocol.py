"""The collectives of a LocalSteps round, on its private group.

Every sync begins with a small header that every rank all-gathers: its round, whether its Δ
was finite or could be computed at all (and which parameter was not), and the digests of its
buffers. A difference in rounds, or any rank's failure, raises the same error on every rank
before anything changes. Then the mean of the ranks' outer gradients: an exact float32
all-reduce (dense) or the exchange of every rank's encoded pieces
(:func:`~gradshare.distributed.exchange.gather_pieces`, whose decode the DDP hook shares),
decoded into the mean, or held for an outer step that decodes them itself.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradshare.codec.flat import slices
from gradshare.distributed.buffers import BufferSync
from gradshare.distributed.exchange import (
    GroupSource,
    collective,
    gather_pieces,
    global_ranks,
)
from gradshare.distributed.local_steps.fragment import Fragment
from gradshare.distributed.metrics import Unsent

__all__ = ["FAILED", "NONFINITE", "OK", "Protocol", "undone_on_error"]

FIELDS = ("round", "status", "bad_parameter")
"""The header's fields, one int64 each (the buffers' digests follow them)."""
OK, NONFINITE, FAILED = 0, 1, 2
"""A rank's status in the header: Δ finite, Δ not finite (``bad_parameter`` names the first
such parameter), or Δ could not be computed (the rank raises its own error)."""


class Protocol:
    """The header, the buffers and the mean of a round, over ``private``.

    Args:
        private: LocalSteps' private group (its timeout bounds every collective).
        group: the user's group (None: the world), to name global ranks in errors.
        device: where the collectives run (the model's device).
        names: every parameter's name, for errors.
        buffers: the model's buffers, whose digests ride with the header.
        divisor: what a round's summed outer gradients are divided by (the world size for
            ``"mean"``).
    """

    __slots__ = (
        "buffers", "device", "divisor", "group", "mean", "names", "private", "rank", "world",
    )  # fmt: skip

    def __init__(
        self,
        private: GroupSource,
        group: dist.ProcessGroup | None,
        device: torch.device,
        names: list[str],
        buffers: BufferSync,
        mean: bool,
    ) -> None:
        self.private = private
        self.group = group
        self.device = device
        self.names = names
        self.buffers = buffers
        self.mean = mean
        """The summed outer gradients are divided by the world size (``"mean"``)."""
        self.world, self.rank, self.divisor = 1, 0, 1
        if dist.is_initialized():
            self.reconfigure(dist.get_rank(group), dist.get_world_size(group))

    def reconfigure(self, rank: int, world: int) -> None:
        """This rank's place in the ranks that take part (another quorum's, elastic)."""
        self.rank, self.world = rank, world
        self.divisor = world if self.mean else 1

    @property
    def timeout(self) -> timedelta:
        return self.private.timeout

    @torch.no_grad()
    def broadcast_from_rank0(self, params: list[torch.nn.Parameter]) -> None:
        """Every parameter takes rank 0's values (once, at construction)."""
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        collective(
            dist.broadcast, flat, src=src, group=self.private.get(), timeout=self.timeout,
            what="parameter broadcast", rank=self.rank,
        )  # fmt: skip
        for p, piece in zip(params, slices(flat, (p.numel() for p in params)), strict=True):
            p.copy_(piece.view_as(p))

    # ------------------------------------------------------------------ a round's steps

    def begin(
        self, fragment: Fragment, round: int, decay: float, sent_from: bool, whole: bool = False
    ) -> int:
        """Δ into the residuals and their encode (:meth:`Fragment.pseudo_gradient_`), then
        the header: a rank whose Δ failed or is not finite stops every rank alike, with every
        residual and encoder as it was; the buffers that differ become rank 0's. Returns the
        bytes this rank sent. ``whole``: every residual goes whole, as dense pieces (a rank
        that leaves)."""
        status, bad, failure = OK, -1, None
        try:
            bad = fragment.pseudo_gradient_(decay, sent_from, round, whole)
            status = OK if bad < 0 else NONFINITE
        except Exception as e:
            status, failure = FAILED, e
        try:
            table = self.header(round, status, bad)
            if failure is not None:
                raise failure
            self.check(table, round)
            return self.take_buffers(table)
        except BaseException:
            if failure is None:  # Δ went into the residuals and was encoded: undone
                fragment.put_back(fragment.before)
            raise

    def mean_job(
        self, fragment: Fragment, round: int, unsent: Unsent, outer: torch.optim.Optimizer
    ) -> tuple[Callable[[], int], list[dict[str, Any]]]:
        """The round's exchange, to run now or in the background (it returns the bytes this
        rank sent, and leaves the mean in the fragment's part of the mean buffer, or the
        validated pieces with the fragment where its outer step decodes them itself:
        :meth:`Fragment.hold`), and every encoder's state from before the round. An encode
        that failed tells the other ranks now and raises, every encoder put back."""
        group = self.private.get()
        if not fragment.encoders:
            return (lambda: self.dense_mean(group, fragment)), []
        hold = fragment.steps_pieces(outer)
        mine, failure, before = fragment.message(unsent)
        if failure is not None:  # nothing is in flight: the others hear of it now
            undone_on_error(
                fragment,
                before,
                lambda: self.encoded_mean(group, fragment, None, failure, round, hold),
            )
        return (lambda: self.encoded_mean(group, fragment, mine, None, round, hold)), before

    # ------------------------------------------------------------------ the header

    def header(self, round: int, status: int = OK, bad: int = -1) -> list[list[int]]:
        """All-gather every rank's ``[round, status, bad_parameter, *buffer digests]``; raise
        the same error on every rank when the rounds differ. Returns the table (a row per
        rank)."""
        row = [round, status, bad, *self.buffers.digests()]
        header = torch.tensor(row, dtype=torch.int64, device=self.device)
        headers = [torch.empty_like(header) for _ in range(self.world)]
        collective(
            dist.all_gather, headers, header, group=self.private.get(), timeout=self.timeout,
            what="sync header (sync)", rank=self.rank,
        )  # fmt: skip
        table = torch.stack(headers).cpu().tolist()
        if len({row[0] for row in table}) > 1:
            rounds = ", ".join(
                f"{row[0]} on rank {r}"
                for r, row in zip(global_ranks(self.private.get()), table, strict=True)
            )
            raise ValueError(
                f"LocalSteps (sync): the ranks are at different sync rounds, `round` {rounds}: "
                "every rank must resume from the checkpoint of the same step."
            )
        return table

    def check(self, table: list[list[int]], round: int) -> None:
        """Raise the same error on every rank when a rank failed or sent a non-finite Δ."""
        ranks = global_ranks(self.private.get())
        failed = [ranks[r] for r, row in enumerate(table) if row[1] == FAILED]
        if failed:
            raise RuntimeError(
                f"LocalSteps sync round {round}: rank(s) {failed} failed to compute their "
                "outer gradient (see their own error); every rank stops here, nothing changed."
            )
        bad = {ranks[r]: row[2] for r, row in enumerate(table) if row[1] == NONFINITE}
        if bad:
            where = ", ".join(f"rank {r} in parameter {self.names[i]!r}" for r, i in bad.items())
            raise ValueError(
                f"LocalSteps sync round {round}: the local parameters moved to non-finite "
                f"values on {where}: no outer step was taken on any rank, the global copy and "
                "the residuals are unchanged. Check the loss or lower the inner learning rate, "
                "then resume from a checkpoint."
            )

    def take_buffers(self, table: list[list[int]]) -> int:
        """Rank 0's buffers wherever a rank's digest differs (a collective); the bytes this
        rank sent (rank 0 sends them)."""
        sent = self.buffers.take([row[len(FIELDS) :] for row in table])
        return sent if self.rank == 0 else 0

    @torch.no_grad()
    def average_(self, params: list[torch.nn.Parameter], copy: list[torch.Tensor]) -> int:
        """Every parameter and its global ``copy`` take the mean of the ranks' parameters
        (one float32 all-reduce, a collective); the bytes this rank sent."""
        flat = torch.cat([p.detach().reshape(-1).float() for p in params]).to(self.device)
        collective(
            dist.all_reduce, flat, group=self.private.get(), timeout=self.timeout,
            what="average of the replicas", rank=self.rank,
        )  # fmt: skip
        flat.div_(self.world)
        for p, g, piece in zip(params, copy, slices(flat, (p.numel() for p in params)),
                               strict=True):  # fmt: skip
            p.copy_(piece.view_as(p))
            g.copy_(piece.view_as(g))
        return 4 * flat.numel()

    # ------------------------------------------------------------------ the mean

    def dense_mean(self, group: Any, fragment: Fragment) -> int:
        """Dense DiLoCo: the exact float32 mean of every rank's Δ of ``fragment`` into its
        part of the mean (Δ stays as it is, for a failed round's undo); the bytes this rank
        sent."""
        out, delta = fragment.mean, fragment.delta
        assert delta is not None
        buf = out.to(self.device)
        buf.copy_(delta)
        collective(
            dist.all_reduce, buf, group=group, timeout=self.timeout, what="dense all-reduce",
            rank=self.rank,
        )  # fmt: skip
        if buf is not out:
            out.copy_(buf)
        out.div_(self.divisor)
        return 4 * fragment.numel

    def encoded_mean(
        self,
        group: Any,
        fragment: Fragment,
        mine: torch.Tensor | None,
        failure: Exception | None,
        round: int,
        hold: bool = False,
    ) -> int:
        """Exchange every rank's message of ``fragment`` (round ``round``), validate each
        piece whole and decode their mean into the fragment's part of the mean (with
        ``hold``: hand the pieces to the fragment, :meth:`Fragment.hold`); the bytes this rank
        sent. With ``failure`` (this rank could not encode) the others raise naming it, and
        this rank raises it."""
        pieces = gather_pieces(
            None if mine is None else mine.to(self.device),
            [p.numel() for p in fragment.params],
            fragment.names,
            group=group,
            timeout=self.timeout,
            device=self.device,
            home=fragment.home,
            failure=failure,
            round=round,
        )
        if hold:
            fragment.hold(pieces, self.divisor)
        else:
            fragment.decode(pieces, self.divisor)
        return pieces.sent


def undone_on_error(
    fragment: Fragment, before: list[dict[str, Any]], job: Callable[[], int]
) -> int:
    """``job()``; if it raises, nothing of the round stays: every encoder as in ``before``."""
    try:
        return job()
    except BaseException:
        fragment.put_back(before)
        raise
