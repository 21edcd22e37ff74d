"""One fragment's parameters, its views of every flat buffer, and the arithmetic of a round.

A :class:`Fragment` is built once, with the views it works on cut once (torchft's
``_StreamingDiLoCoFragment`` is the model): its parameters, their global copy and encoders,
and its part of Δ (or of the send point), of the mean, of the residuals' backup and of the base.
Its methods are the steps of one round on them (the pseudo-gradient into the residuals and the
encode, the outer step, the model taking the global copy, the carry of an overlapped round),
each in as few passes over the model as it can; the collectives are
:mod:`.protocol`'s and the order of events :class:`~gradshare.LocalSteps`' and :mod:`.overlap`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gradshare import codec
from gradshare.codec import multipart
from gradshare.codec.flat import slices
from gradshare.distributed.exchange import Pieces
from gradshare.distributed.local_steps.outer import plain_sgd, took_step
from gradshare.distributed.local_steps.schedule import Span
from gradshare.distributed.metrics import Unsent
from gradshare.encoding.encoder import Encoder, EncodeStats, sample_span

__all__ = ["Buffers", "Fragment", "OuterStepError", "build_fragments"]


class OuterStepError(ValueError):
    """An outer step that raised or left the global copy non-finite: syncing stops."""


@dataclass(frozen=True, slots=True)
class Buffers:
    """LocalSteps' flat float32 buffers, each cut into the fragments' views once."""

    mean: torch.Tensor
    """The model's mean outer gradient (a round's, until its outer step)."""
    delta: torch.Tensor | None
    """Δ of the round, kept for dense syncs (their message) and for the lead (a failed round
    takes it again); None for other encoded syncs (Δ goes into the residuals in the pass
    that computes it)."""
    backup: torch.Tensor | None
    """The residuals of the fragment being synced as they were before its Δ was added,
    while its round may still fail (one fragment's size: one round at a time); None for
    dense syncs."""
    base: torch.Tensor | None
    """With ``overlap``: the next round's start less the global copy (the carry); with the
    lead (τ = ``sync_every``) or dense syncs, for the fragment whose round is in flight (or
    whose mean waits for its merge), this replica's parameters at its send instead. None
    without overlap."""
    sent: torch.Tensor | None = None
    """With encoded syncs and τ < ``sync_every``: for the fragment whose round is in flight
    (or whose mean waits for its merge), this replica's parameters at its send, written by
    its Δ pass (where Δ itself was kept before: a failed round's carry is then still the
    base). None otherwise."""


class Fragment:
    """A run of parameters synced together, with the views of every buffer it works on."""

    __slots__ = (
        "backups", "base", "bases", "before", "compact", "decayed", "delta", "deltas", "encoders",
        "failure", "globals", "home", "mean", "means", "names", "params", "pieces", "received",
        "sent", "sents", "span", "swap", "whole",
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
        swap: bool,
        compact: bool,
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
        self.sent = own(buffers.sent)
        self.sents: list[torch.Tensor | None] = cut(buffers.sent, True)
        self.means: list[torch.Tensor] = cut(buffers.mean, True)
        self.deltas: list[torch.Tensor | None] = cut(buffers.delta, True)
        self.backups: list[torch.Tensor | None] = cut(buffers.backup, False)  # one at a time
        """Per parameter: its residual from before the round in progress. Each fragment's
        own, or one fragment's size shared by all (one round at a time)."""
        self.compact = compact
        """Send sparse pieces in their compact form (LocalSteps' setting)."""
        self.swap = swap
        """The backups are this fragment's alone (one fragment): the Δ pass writes the new
        residual into the backup and the two swap, where else the old one is copied."""
        self.decayed = 0
        """Residuals the round in progress has decayed (:meth:`restore_residuals`)."""
        self.before: list[dict[str, Any]] = []
        """Every encoder's state from before the round in progress."""
        self.pieces: list[tuple[torch.Tensor | None, float]] = []
        """The round's pieces so far, with their thresholds (:meth:`message`)."""
        self.failure: Exception | None = None
        """Why the round's encoding failed, or None."""
        self.received: tuple[Pieces, int] | None = None
        """The round's pieces and divisor, held for the outer step (:meth:`hold`)."""
        self.bases: list[torch.Tensor | None] = cut(buffers.base, True)

    @property
    def numel(self) -> int:
        return self.span.numel

    def set_encoders(self, encoders: list[Encoder]) -> None:
        """Its encoders replaced (a loaded state's); no round is in progress."""
        self.encoders[:] = encoders
        self.decayed = 0

    def stats(self) -> list[EncodeStats | None]:
        return [e.last_stats for e in self.encoders]

    # ------------------------------------------------------------------ Δ, the encode

    def pseudo_gradient_(
        self, decay: float, sent_from: bool, round: int, whole: bool = False
    ) -> int:
        """Δ = start - local for this fragment's parameters, in float32; the model index of
        the first parameter whose Δ is not finite (-1 when all are). Dense syncs and
        ``overlap`` keep Δ in Δ. Encoded syncs add it into each residual as it decays
        (residual = β·residual + Δ) in the one pass that computes it, sampled where round
        ``round``'s threshold looks (:func:`~gradshare.encoding.encoder.sample_span`), and
        encode the parameter at once (:meth:`message` joins the pieces), while its new
        residual is still in cache: a pass over every residual later read them all from
        memory again. The old residuals are kept: with one fragment each new one is written
        beside it and the two swap (:attr:`swap`), else it is copied into the backup. An
        encode that fails ends the encoding (:meth:`message` tells it). If this raises, or a
        Δ is not finite, every residual and encoder is as it was. The start is the global
        copy; with overlap, plus the base (the carry), or the base itself when ``sent_from``
        (the last round's mean waits for its merge: where that round was sent from, the lead
        included).
        """
        self.decayed = 0
        self.before = [enc.state_dict(residual=False) for enc in self.encoders]
        self.pieces, self.failure = [], None
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
                    if codec.subtract_(start, local, d, plus=b):
                        return self.span.first + j
                    continue
                nonfinite, magnitudes = self._decay_one(j, decay, start, local, b, round)
                if nonfinite:  # the round stops on every rank: nothing more to compute
                    self.put_back(self.before)
                    return self.span.first + j
                if self.failure is None:
                    self._encode_one(j, round, magnitudes, whole)
        except BaseException:
            self.put_back(self.before)
            raise
        return -1

    def _decay_one(
        self,
        j: int,
        decay: float,
        start: torch.Tensor,
        local: torch.Tensor,
        plus: torch.Tensor | None,
        round: int,
    ) -> tuple[int, torch.Tensor | None]:
        """Parameter ``j``'s Δ into its residual: the non-finite count, and the new
        residual's magnitudes where its threshold samples (the residual is as it was again
        after :meth:`restore_residuals`, :attr:`decayed` counting it)."""
        enc, keep = self.encoders[j], self.backups[j]
        assert keep is not None
        if enc.residual is None:
            enc.residual = torch.zeros_like(local)
        sample, m = None, None
        k = enc.algorithm.samples
        if k and not self.whole[j]:
            first, stride = sample_span(local.numel(), k, round)
            m = torch.empty(len(range(first, local.numel(), stride)), device=self.home)
            sample = (m, first, stride)
        d, sent = self.deltas[j], self.sents[j]  # Δ kept, or the send point noted
        if not self.swap:
            bad = codec.decay_add_(
                enc.residual, decay, keep, start, local, plus=plus, out=d, sample=sample, copy=sent
            )
            self.decayed += 1
            return bad, m
        try:
            bad = codec.decay_into_(
                enc.residual, decay, keep, start, local, plus=plus, out=d, sample=sample, copy=sent
            )
        finally:  # the old residual becomes the backup, also should the kernel have raised
            enc.residual, self.backups[j] = keep, enc.residual
            self.decayed += 1
        return bad, m

    def _encode_one(
        self, j: int, round: int, magnitudes: torch.Tensor | None, whole: bool = False
    ) -> None:
        """Encode parameter ``j``'s residual (its piece of this rank's message, compact with
        :attr:`compact`); an error is kept in :attr:`failure`."""
        enc = self.encoders[j]
        try:
            message: torch.Tensor | None
            if whole or self.whole[j]:  # too small (or leaving): a dense piece
                message = enc.encode_whole(None, round)
            else:
                message = enc.encode(None, round, magnitudes=magnitudes)
            if self.compact and message is not None:
                message = codec.compact_message(message)
            assert enc.last_stats is not None
            self.pieces.append((message, enc.last_stats.threshold))
        except Exception as e:
            self.failure = e

    def restore_residuals(self) -> None:
        """The residuals that :meth:`pseudo_gradient_` decayed back as they were before it
        (swapped back, or copied from the backup)."""
        for j in range(self.decayed):
            enc, keep = self.encoders[j], self.backups[j]
            assert enc.residual is not None and keep is not None
            if self.swap:
                enc.residual, self.backups[j] = keep, enc.residual
            else:
                enc.residual.copy_(keep)
        self.decayed = 0

    def message(
        self, unsent: Unsent
    ) -> tuple[torch.Tensor | None, Exception | None, list[dict[str, Any]]]:
        """This rank's message of the round (its parameters' pieces, made by
        :meth:`pseudo_gradient_`, back to back), the error if encoding failed, and every
        encoder's state from before the round (a round that fails puts it back whole:
        :meth:`put_back`). Each parameter's stats count in ``unsent``."""
        mine, failure = None, self.failure
        if failure is None:
            try:
                for name, enc in zip(self.names, self.encoders, strict=True):
                    unsent.count(name, enc.last_stats)
                mine = multipart.join_messages(
                    [m for m, _ in self.pieces],
                    [p.numel() for p in self.params],
                    [t for _, t in self.pieces],
                    self.home,
                )
            except Exception as e:
                failure = e
        self.pieces = []
        return mine, failure, self.before

    def put_back(self, before: list[dict[str, Any]]) -> None:
        """Every residual and encoder as before the round (:meth:`message`'s ``before``)."""
        self.restore_residuals()
        for enc, state in zip(self.encoders, before, strict=True):
            enc.load_state_dict({**state, "residual": enc.residual})

    # ------------------------------------------------------------------ the step

    def steps_pieces(self, outer: torch.optim.Optimizer) -> bool:
        """Whether ``outer``'s step takes the round's pieces as they are (:meth:`outer_step`):
        the exchange then holds them here (:meth:`hold`) rather than decoding the mean."""
        lrs = plain_sgd(outer) if self.home.type == "cpu" else None
        return lrs is not None and all(_fits(lrs.get(id(g)), g.dtype) for g in self.globals)

    def hold(self, pieces: Pieces, divisor: int) -> None:
        """Keep the round's validated pieces (and the ``divisor`` of their sum) for the outer
        step, which decodes them as it needs (:meth:`outer_step`)."""
        self.received = (pieces, divisor)

    def settle_mean(self) -> None:
        """The mean of held pieces decoded into the mean buffer (a state saves it there)."""
        if self.received is not None:
            self.decode(*self.received)
            self.received = None

    def decode(self, pieces: Pieces, divisor: int) -> None:
        """The mean of the round's validated pieces into this fragment's part of the mean."""
        for j, m in enumerate(self.means):
            codec.decode_sum_(pieces.of(j), m, divisor=divisor, names=pieces.names, checked=True)

    def outer_step(self, outer: torch.optim.Optimizer, what: str) -> None:
        """The outer optimizer steps this fragment's global copy with the mean as its
        gradient (the others have none: it leaves them as they are). Plain SGD with the
        pieces held (:meth:`hold`) on the CPU steps only the elements they name, checking
        those; any other step has the mean decoded in full first and checks every element.

        Raises:
            OuterStepError: the step raised, or left the global copy non-finite (``what``
                names the round and the optimizer).
        """
        received, self.received = self.received, None
        if received is not None and self.steps_pieces(outer):
            lrs = plain_sgd(outer)
            assert lrs is not None
            failure = self._plain_step(received[0], received[1], lrs)
            took_step(outer)
        else:
            if received is not None:
                self.decode(*received)
            failure = self._own_step(outer)
        if failure is not None:
            raise OuterStepError(
                f"{what}: the outer step {failure}, from a finite mean outer gradient: its "
                "learning rate is too large for it. The model kept its replica and syncing "
                "stopped; resume from a checkpoint with a lower outer learning rate."
            )

    def _plain_step(self, pieces: Pieces, divisor: int, lrs: dict[int, float]) -> str | None:
        """Plain SGD's step on the elements the pieces name (:func:`codec.step_sum_`); what
        failed, or None."""
        bad = None
        for j, (g, m) in enumerate(zip(self.globals, self.means, strict=True)):
            if (
                codec.step_sum_(
                    pieces.of(j),
                    g.view(-1),
                    m,
                    lr=lrs[id(g)],
                    divisor=divisor,
                    names=pieces.names,
                    checked=True,
                )
                and bad is None
            ):
                bad = self.names[j]
        return None if bad is None else f"turned the global copy of parameter {bad!r} non-finite"

    def _own_step(self, outer: torch.optim.Optimizer) -> str | None:
        """The optimizer's own step with the mean (decoded in full) as the gradient, every
        element checked after; what failed, or None."""
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
        return failure

    def take_global(self) -> None:
        """The model's parameters take the global copy."""
        for g, p in zip(self.globals, self.params, strict=True):
            p.detach().copy_(g)

    # ------------------------------------------------------------------ overlap's carry

    def note_send_point(self) -> None:
        """The round is sent from the replica now: its Δ pass noted it (:attr:`sents`), or
        the base takes it."""
        if self.sent is not None:
            return
        for p, b in zip(self.params, self.bases, strict=True):
            assert b is not None
            b.copy_(p.detach().reshape(-1))

    def merge(self, step: Any) -> None:
        """τ < ``sync_every``, τ steps after this fragment's sync (its round received):
        ``step(self)`` takes the outer step, then in one pass the carry (what the replica
        moved since the send: sent-from - now, the next Δ includes it) goes into the base and
        the model takes the global copy. Should the step fail, the carry is kept alone."""
        try:
            step(self)
        except BaseException:
            self._keep_carry(take=False)
            raise
        self._keep_carry(take=True)

    def _keep_carry(self, take: bool) -> None:
        """base = sent-from - replica (and with ``take`` the replica = global copy), one pass
        where the replica is float32 on this fragment's device."""
        sent = self.sents if self.sent is not None else self.bases
        for p, g, b, s in zip(self.params, self.globals, self.bases, sent, strict=True):
            assert b is not None and s is not None
            local = p.detach().reshape(-1)
            if local.dtype == torch.float32 and local.device == self.home:
                codec.subtract_(s, local, b, then=g.reshape(-1) if take else None)
                continue
            torch.sub(s, local.to(self.home, torch.float32), out=b)
            if take:
                p.detach().copy_(g)

    def unsend(self) -> None:
        """The round's exchange failed: its Δ is taken again at the next sync, as without
        overlap: the base is the start the round was measured from, less the global copy
        (kept as it was, where the Δ pass noted the send point elsewhere)."""
        if self.sent is not None:
            return
        for g, b, d in zip(self.globals, self.bases, self.deltas, strict=True):
            assert b is not None and d is not None
            b.add_(d).sub_(g.reshape(-1))

    def merge_keeping_moves(self, step: Any) -> None:
        """Flush: ``step(self)`` takes the outer step; the model takes the global copy plus
        what this replica moved since the send, and the base is zeroed."""
        sent = self.sents if self.sent is not None else self.bases
        for p, b, s in zip(self.params, self.bases, sent, strict=True):
            assert b is not None and s is not None
            torch.sub(p.detach().reshape(-1).to(self.home), s, out=b)  # moved since
        step(self)
        for p, g, b in zip(self.params, self.globals, self.bases, strict=True):
            assert b is not None
            p.detach().copy_(torch.add(g, b.view_as(g)).to(p.device, p.dtype))
            b.zero_()

    def merge_with_lead(self, step: Any) -> None:
        """τ = ``sync_every``, at a sync whose Δ is taken: ``step(self)`` steps the global
        copy with the last round's mean, and the next round starts from it one outer step
        ahead (the lead: that step again, standing in for the round now launched), the
        round now launched sent from there (the base, in the same pass)."""
        for g, b in zip(self.globals, self.bases, strict=True):
            assert b is not None
            b.copy_(g.reshape(-1))
        step(self)
        for g, b, p in zip(self.globals, self.bases, self.params, strict=True):
            assert b is not None
            torch.sub(g.reshape(-1), b, out=b)  # the lead: this merge's outer step
            if p.dtype == g.dtype == torch.float32 and p.device == b.device:
                p.detach().copy_(torch.add(g.reshape(-1), b, out=b).view_as(p))
            else:
                p.detach().copy_(torch.add(g, b.view_as(g)).to(g.dtype))
                b.copy_(p.detach().reshape(-1))

    def give_back_carry(self) -> None:
        """Flush, nothing in flight here: the carry (or lead) back into the model."""
        for p, b in zip(self.params, self.bases, strict=True):
            assert b is not None
            p.detach().sub_(b.view_as(p).to(p.device, p.dtype))

    def base_state(self, flight: bool) -> torch.Tensor:
        """Its part of the base as a state records it: where its round was sent from while
        one is in flight (``flight``) or waits, else the carry."""
        part = self.sent if flight and self.sent is not None else self.base
        assert part is not None  # overlap's
        return part

    def load_base(self, base: torch.Tensor, flight: bool) -> None:
        """Its part of a loaded state's base (:meth:`base_state`)."""
        target = self.sent if flight and self.sent is not None else self.base
        assert target is not None
        target.copy_(base)


def _fits(lr: float | None, dtype: torch.dtype) -> bool:
    """Whether plain SGD steps a tensor of ``dtype`` with ``lr`` (else torch raises)."""
    return lr is not None and 0 <= lr <= torch.finfo(dtype).max


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
    send_in_pass: bool,
    compact: bool,
) -> tuple[list[Fragment], Buffers]:
    """The flat buffers for ``params`` (float32, on ``home``) and one :class:`Fragment` per
    span, its views cut once; ``send_in_pass``: the Δ pass notes the send point
    (:attr:`Buffers.sent`)."""
    f32 = torch.float32
    numel = sum(p.numel() for p in params)
    largest = max(s.numel for s in spans)
    buffers = Buffers(
        mean=torch.zeros(numel, dtype=f32, device=home),
        delta=torch.zeros(numel, dtype=f32, device=home) if keep_delta else None,
        backup=torch.empty(largest, dtype=f32, device=home) if encoders else None,
        base=torch.zeros(numel, dtype=f32, device=home) if overlap else None,
        sent=torch.zeros(numel, dtype=f32, device=home) if send_in_pass else None,
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
            len(spans) == 1,
            compact,
        )
        for s in spans
    ]
    return fragments, buffers
