"""One fragment's parameters, its views of every flat buffer, and the arithmetic of a round.

A :class:`Fragment` is built once, with the views it works on cut once (torchft's
``_StreamingDiLoCoFragment`` is the model): its parameters, their global copy and encoders,
and its part of Δ, of the mean, of the residuals' backup and of the base. Its methods are the
steps of one round on them (the pseudo-gradient into the residuals, the encode, the outer step,
the model taking the global copy, the carry of an overlapped round); the collectives are
:mod:`.protocol`'s and the order of events :class:`~gradshare.LocalSteps`' and :mod:`.overlap`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gradshare import codec
from gradshare.codec import multipart
from gradshare.codec.flat import slices
from gradshare.distributed.local_steps.schedule import Span
from gradshare.distributed.metrics import Unsent
from gradshare.encoding.encoder import Encoder, EncodeStats

__all__ = ["Buffers", "Fragment", "OuterStepError", "build_fragments"]


class OuterStepError(ValueError):
    """An outer step that raised or left the global copy non-finite: syncing stops."""


@dataclass(frozen=True, slots=True)
class Buffers:
    """LocalSteps' flat float32 buffers, each cut into the fragments' views once."""

    mean: torch.Tensor
    """The model's mean outer gradient (a round's, until its outer step)."""
    delta: torch.Tensor | None
    """Δ of the round, kept for dense syncs (their message) and for ``overlap`` (a failed
    round takes it again); None for encoded syncs without overlap (Δ goes into the residuals
    in the pass that computes it)."""
    backup: torch.Tensor | None
    """The residuals of the fragment being synced as they were before its Δ was added,
    while its round may still fail (one fragment's size: one round at a time); None for
    dense syncs."""
    base: torch.Tensor | None
    """With ``overlap``: for the fragment whose round is in flight (or whose mean waits for
    its merge), this replica's parameters at its send; elsewhere the next round's start less
    the global copy (the carry). None without overlap."""


class Fragment:
    """A run of parameters synced together, with the views of every buffer it works on."""

    __slots__ = (
        "backups", "base", "bases", "delta", "deltas", "encoders", "globals", "home", "mean",
        "means", "names", "params", "span", "whole",
    )  # fmt: skip

    def __init__(
        self,
        span: Span,
        names: list[str],
        params: list[torch.nn.Parameter],
        global_params: list[torch.Tensor],
        encoders: list[Encoder],
        whole: list[bool],
        buffers: Buffers,
        home: torch.device,
    ) -> None:
        self.span = span
        self.names = names
        """Its parameters' names (for errors and warnings)."""
        self.params = params
        self.globals = global_params
        """Its parameters' part of the global copy."""
        self.encoders = encoders
        """Per parameter: its residual and threshold state (none for dense syncs)."""
        self.whole = whole
        """Per parameter: too small for threshold messages, so sent whole (a dense piece)."""
        self.home = home
        sizes = [p.numel() for p in params]
        n = len(params)

        def cut(flat: torch.Tensor | None, own: bool) -> list[Any]:
            if flat is None or not flat.numel():
                return [None] * n
            return list(slices(flat[span.start : span.stop] if own else flat, sizes))

        def own(flat: torch.Tensor | None) -> torch.Tensor | None:
            return None if flat is None or not flat.numel() else flat[span.start : span.stop]

        self.mean = buffers.mean[span.start : span.stop]
        """Its part of the mean outer gradient (flat; :attr:`means` per parameter)."""
        self.delta = own(buffers.delta)
        self.base = own(buffers.base)
        self.means: list[torch.Tensor] = cut(buffers.mean, True)
        self.deltas: list[torch.Tensor | None] = cut(buffers.delta, True)
        self.backups: list[torch.Tensor | None] = cut(buffers.backup, False)  # one at a time
        self.bases: list[torch.Tensor | None] = cut(buffers.base, True)

    @property
    def numel(self) -> int:
        return self.span.numel

    def stats(self) -> list[EncodeStats | None]:
        return [e.last_stats for e in self.encoders]

    # ------------------------------------------------------------------ Δ into the residuals

    def pseudo_gradient_(self, decay: float, sent_from: bool) -> int:
        """Δ = start - local for this fragment's parameters, in float32; the model index of
        the first parameter whose Δ is not finite (-1 when all are). Encoded syncs add it into
        each residual as it decays (residual = β·residual + Δ, the old residual kept in the
        backup), in the one pass that computes it; dense syncs and ``overlap`` keep it in Δ.
        If this raises, every residual is as it was. The start is the global copy; with
        overlap, plus the base (the carry), or the base itself when ``sent_from`` (the last
        round's mean waits for its merge: where that round was sent from, the lead included).
        """
        bad, done = -1, 0
        try:
            for j, (g, p) in enumerate(zip(self.globals, self.params, strict=True)):
                local = p.detach().to(self.home, torch.float32).reshape(-1)
                start, b = g.reshape(-1).to(torch.float32), self.bases[j]
                if sent_from:
                    assert b is not None  # a round received: overlap's base
                    start, b = b, None
                if not self.encoders:
                    d = self.deltas[j]
                    assert d is not None  # dense syncs keep Δ
                    nonfinite = codec.subtract_(start, local, d, plus=b)
                else:
                    enc = self.encoders[j]
                    if enc.residual is None:
                        enc.residual = torch.zeros_like(local)
                    keep = self.backups[j]
                    assert keep is not None
                    nonfinite = codec.decay_add_(
                        enc.residual, decay, keep, start, local, plus=b, out=self.deltas[j]
                    )
                    done += 1
                if bad < 0 and nonfinite:
                    bad = self.span.first + j
        except BaseException:
            self.restore_residuals(done)
            raise
        return bad

    def restore_residuals(self, count: int | None = None) -> None:
        """The residuals of the first ``count`` parameters (all) back from the backup, as they
        were before :meth:`pseudo_gradient_`."""
        for enc, keep in zip(self.encoders[:count], self.backups, strict=False):
            assert enc.residual is not None and keep is not None
            enc.residual.copy_(keep)

    # ------------------------------------------------------------------ the encode

    def encode(
        self, round: int, compact: bool, unsent: Unsent, whole: bool = False
    ) -> tuple[torch.Tensor | None, Exception | None, list[dict[str, Any]]]:
        """Encode each residual (β·residual + Δ, :meth:`pseudo_gradient_`'s) into this
        rank's message, its parameters' pieces back to back. Returns the message, the error
        if encoding failed, and every encoder's state from before this round (a round that
        fails puts it back whole: the decay, Δ, what was encoded and the threshold state; the
        residuals themselves are in the backup). ``whole``: every residual goes whole, a
        dense piece (a rank that leaves)."""
        sent: list[tuple[torch.Tensor | None, float]] = []
        mine, failure = None, None
        before = [enc.state_dict(residual=False) for enc in self.encoders]
        try:
            for j, (enc, state) in enumerate(zip(self.encoders, before, strict=True)):
                state["residual"] = self.backups[j]
                message: torch.Tensor | None
                if whole or self.whole[j]:  # too small (or leaving): a dense piece
                    message = enc.encode_whole(None, round)
                else:
                    message = enc.encode(None, round)
                if compact and message is not None:
                    message = codec.compact_message(message)
                assert enc.last_stats is not None
                unsent.count(self.names[j], enc.last_stats)
                sent.append((message, enc.last_stats.threshold))
            mine = multipart.join_messages(
                [m for m, _ in sent],
                [p.numel() for p in self.params],
                [t for _, t in sent],
                self.home,
            )
        except Exception as e:
            failure = e
        return mine, failure, before

    def put_back(self, before: list[dict[str, Any]]) -> None:
        """Every encoder as it was before the round (:meth:`encode`'s ``before``)."""
        for enc, state in zip(self.encoders, before, strict=True):
            enc.load_state_dict(state)

    # ------------------------------------------------------------------ the step

    def outer_step(self, outer: torch.optim.Optimizer, what: str) -> None:
        """The outer optimizer steps this fragment's global copy with the mean as its
        gradient (the others have none: it leaves them as they are).

        Raises:
            OuterStepError: the step raised, or left the global copy non-finite (``what``
                names the round and the optimizer).
        """
        for g, m in zip(self.globals, self.means, strict=True):
            g.grad = m.view_as(g).to(g.dtype)
        failure = None
        try:
            outer.step()
        except Exception as e:  # e.g. an lr that does not fit the global copy's dtype
            failure = f"raised {type(e).__name__}: {e}"
        for g in self.globals:
            g.grad = None
        if failure is None:
            bad = [n for n, g in zip(self.names, self.globals, strict=True)
                   if codec.find_nonfinite(g.reshape(-1))[0]]  # fmt: skip
            if bad:
                failure = f"turned the global copy of parameter {bad[0]!r} non-finite"
        if failure is not None:
            raise OuterStepError(
                f"{what}: the outer step {failure}, from a finite mean outer gradient: its "
                "learning rate is too large for it. The model kept its replica and syncing "
                "stopped; resume from a checkpoint with a lower outer learning rate."
            )

    def take_global(self) -> None:
        """The model's parameters take the global copy."""
        for g, p in zip(self.globals, self.params, strict=True):
            p.detach().copy_(g)

    # ------------------------------------------------------------------ overlap's carry

    def note_send_point(self) -> None:
        """The base holds where this round is sent from: the replica now."""
        for p, b in zip(self.params, self.bases, strict=True):
            assert b is not None
            b.copy_(p.detach().reshape(-1))

    def keep_carry(self) -> None:
        """At the merge: what the replica moved since the send becomes its carry (the base:
        sent-from - now), which the next Δ includes."""
        for p, b in zip(self.params, self.bases, strict=True):
            assert b is not None
            b.sub_(p.detach().reshape(-1).to(self.home))

    def unsend(self) -> None:
        """The round's exchange failed: its Δ is taken again at the next sync, as without
        overlap; the base goes back from the send point to the start the round was measured
        from (less the global copy)."""
        for g, b, d in zip(self.globals, self.bases, self.deltas, strict=True):
            assert b is not None and d is not None
            b.add_(d).sub_(g.reshape(-1))

    def merge_keeping_moves(self, step: Any) -> None:
        """Flush: ``step(self)`` takes the outer step; the model takes the global copy plus
        what this replica moved since the send, and the base is zeroed."""
        for p, b in zip(self.params, self.bases, strict=True):
            assert b is not None
            torch.sub(p.detach().reshape(-1).to(self.home), b, out=b)  # moved since
        step(self)
        for p, g, b in zip(self.params, self.globals, self.bases, strict=True):
            assert b is not None
            p.detach().copy_(torch.add(g, b.view_as(g)).to(p.device, p.dtype))
            b.zero_()

    def merge_with_lead(self, step: Any) -> None:
        """τ = ``sync_every``, at a sync whose Δ is taken: ``step(self)`` steps the global
        copy with the last round's mean, and the next round starts from it one outer step
        ahead (the lead: that step again, standing in for the round now launched)."""
        for g, b in zip(self.globals, self.bases, strict=True):
            assert b is not None
            b.copy_(g.reshape(-1))
        step(self)
        for g, b, p in zip(self.globals, self.bases, self.params, strict=True):
            assert b is not None
            torch.sub(g.reshape(-1), b, out=b)  # the lead: this merge's outer step
            p.detach().copy_(torch.add(g, b.view_as(g)).to(g.dtype))

    def give_back_carry(self) -> None:
        """Flush, nothing in flight here: the carry (or lead) back into the model."""
        for p, b in zip(self.params, self.bases, strict=True):
            assert b is not None
            p.detach().sub_(b.view_as(p).to(p.device, p.dtype))


def build_fragments(
    spans: list[Span],
    names: list[str],
    params: list[torch.nn.Parameter],
    global_params: list[torch.Tensor],
    encoders: list[Encoder],
    whole: list[bool],
    *,
    home: torch.device,
    keep_delta: bool,
    overlap: bool,
) -> tuple[list[Fragment], Buffers]:
    """The flat buffers for ``params`` (float32, on ``home``) and one :class:`Fragment` per
    span, its views cut once."""
    f32 = torch.float32
    numel = sum(p.numel() for p in params)
    largest = max(s.numel for s in spans)
    buffers = Buffers(
        mean=torch.zeros(numel, dtype=f32, device=home),
        delta=torch.zeros(numel, dtype=f32, device=home) if keep_delta else None,
        backup=torch.empty(largest, dtype=f32, device=home) if encoders else None,
        base=torch.zeros(numel, dtype=f32, device=home) if overlap else None,
    )
    fragments = [
        Fragment(
            s,
            names[s.first : s.last],
            params[s.first : s.last],
            global_params[s.first : s.last],
            encoders[s.first : s.last],
            whole[s.first : s.last],
            buffers,
            home,
        )
        for s in spans
    ]
    return fragments, buffers
