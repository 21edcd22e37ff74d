"""``LocalSteps(overlap=τ)``: the round in flight, its merge, the carry and the lead.

With overlap, round k's exchange runs while every rank takes the next τ inner steps, and its
mean is merged after them (:class:`~gradshare.LocalSteps` tells the whole story).
:class:`InFlightRound` holds that one round: the background thread, the round's future, what
undoes the round should its exchange fail, and whether its mean waits for the merge; it knows
nothing of the exchange itself. :class:`Overlap` launches rounds and merges them on the
fragments' views: the carry (what a replica moved since its round's send), the lead (τ =
``sync_every``), the flush.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from gradshare.distributed.exchange import Pipeline
from gradshare.distributed.local_steps.fragment import Fragment
from gradshare.encoding.encoder import EncodeStats

__all__ = ["InFlightRound", "Overlap"]

Step = Callable[[Fragment], None]
"""Takes a fragment's outer step (LocalSteps' own, which names a failure)."""

logger = logging.getLogger(__name__)


class InFlightRound:
    """The round of an overlapping LocalSteps whose exchange runs in the background, then
    its mean until the merge.

    One at a time: :meth:`launch` hands the exchange to a one-thread
    :class:`~gradshare.distributed.exchange.Pipeline`, which then issues the only collectives
    on LocalSteps' private group (LocalSteps issues none before :meth:`wait`); the exchange
    leaves the round's mean in the mean buffer, where it stays (:attr:`received`) until
    :meth:`take` hands it to the merge.
    """

    __slots__ = ("_device", "_future", "_pipeline", "_stats", "_undo", "received", "shown")

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._pipeline = Pipeline("gradshare-local-steps")
        self._future: torch.futures.Future[int] | None = None
        self._undo: Callable[[], None] = _nothing
        self._stats: list[EncodeStats | None] = []
        self.received = False
        """A round's mean waits in the mean buffer for its merge."""
        self.shown: list[EncodeStats | None] = []
        """The encode stats of the last round whose exchange completed (for ``metrics()``)."""

    def launch(
        self, job: Callable[[], int], undo: Callable[[], None], stats: list[EncodeStats | None]
    ) -> None:
        """Run ``job`` (the exchange, returning the bytes this rank sent) in the background;
        ``undo()`` puts back what the round changed, should it fail."""
        assert self._future is None and not self.received, "one round at a time"
        ready = None
        if self._device.type == "cuda":  # the job's stream waits for this thread's work
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self._device))

        def run() -> int:
            if ready is None:
                return job()
            with torch.cuda.device(self._device):
                stream = torch.cuda.current_stream()
                stream.wait_event(ready)
                sent = job()
                stream.synchronize()  # the mean is whole before the future completes
                return sent

        self._future = self._pipeline.submit(run)
        self._undo, self._stats = undo, stats

    def wait(self) -> int | None:
        """Wait for the round in flight; the bytes it sent (None: none was in flight). If its
        exchange failed: undo the round and raise the exchange's error."""
        future, undo = self._future, self._undo
        if future is None:
            return None
        try:
            sent = future.wait()
        except Exception:
            self._future, self._undo = None, _nothing
            self._pipeline.clear_failure()
            undo()
            raise
        self._future, self._undo = None, _nothing
        self.received, self.shown = True, self._stats
        return sent

    def take(self) -> bool:
        """Whether a round's mean waits for its merge; the merge takes it."""
        received, self.received = self.received, False
        return received

    def drop(self) -> None:
        """Forget the round (a loaded state replaces it), once its exchange has ended."""
        future, self._future, self._undo = self._future, None, _nothing
        self.received = False
        if future is not None:
            try:
                future.wait()
            except Exception as e:
                self._pipeline.clear_failure()
                logger.warning("LocalSteps: the round in flight failed before a load: %s", e)

    def close(self) -> None:
        """End the background thread (none is left running: nothing is in flight)."""
        if self._future is None:
            self._pipeline.close()


def _nothing() -> None:
    pass


class Overlap:
    """The rounds of an overlapping LocalSteps: launched in the background, merged τ steps
    later (or, with τ = ``sync_every``, at the next sync with a lead), flushed at the end.

    Args:
        fragments: the model's fragments (their bases are the carry).
        base: the flat base buffer they are views of.
        device: the model's device (the background exchange's stream waits for its work).
        step: takes a fragment's outer step.
    """

    __slots__ = ("base", "flight", "fragments", "round", "step")

    def __init__(
        self, fragments: list[Fragment], base: torch.Tensor, device: torch.device, step: Step
    ) -> None:
        self.fragments = fragments
        self.base = base
        self.step = step
        self.round = InFlightRound(device)
        self.flight: int | None = None
        """The fragment whose round is in flight or waits for its merge."""

    @property
    def received(self) -> bool:
        """A round's mean waits for its merge."""
        return self.round.received

    def receive(self) -> tuple[int, int] | None:
        """Wait for the round in flight: (the bytes it sent, its elements), or None when none
        was in flight. A failed round is undone and its error raised."""
        flight = self.flight
        sent = self.round.wait()
        if sent is None:
            return None
        if flight is None:
            numel = sum(f.numel for f in self.fragments)
        else:
            numel = self.fragments[flight].numel
        logger.debug("LocalSteps: a round of %d elements arrived, %d bytes sent", numel, sent)
        return sent, numel

    def launch(
        self,
        fragment: Fragment,
        job: Callable[[], int],
        before: list[dict[str, Any]],
        undone: Callable[[], None],
    ) -> None:
        """After the header and the encode: merge the last round if its mean waits (τ =
        ``sync_every``: with a lead), note where this round is sent from and run ``job``
        (its exchange) in the background. Should it fail, the encoders are put back as in
        ``before``, the round's Δ goes back into the carry, and ``undone()`` is called."""
        if self.round.take():
            self.merge_with_lead()  # the send point too
        else:
            fragment.note_send_point()

        def undo() -> None:  # the exchange failed: nothing of this round stays
            fragment.put_back(before)
            fragment.unsend()
            self.flight = None
            undone()

        self.round.launch(job, undo, fragment.stats())
        self.flight = fragment.span.index

    def merge(self) -> None:
        """τ < ``sync_every``, τ steps after a fragment's sync (its round received): step the
        fragment's global copy with its mean and the model takes it; what the replica moved
        since the send becomes its carry."""
        if not self.round.take():
            return  # none in flight: before the first sync, or after a flush
        assert self.flight is not None  # a round received is a fragment's
        self.fragments[self.flight].merge(self.step)
        self.flight = None

    def merge_with_lead(self) -> None:
        """τ = ``sync_every``, at a sync whose Δ is taken (one fragment: the whole model)."""
        self.fragments[0].merge_with_lead(self.step)
        self.flight = None

    def flush(self) -> None:
        """Merge the received round now, keeping this replica's moves since its send, then
        give every carry (or lead) back to the model (the caller has received)."""
        flight, self.flight = self.flight, None
        if self.round.take():
            assert flight is not None  # a round received is a fragment's
            self.fragments[flight].merge_keeping_moves(self.step)
        for fragment in self.fragments:
            fragment.give_back_carry()
        self.base.zero_()

    def base_state(self) -> torch.Tensor:
        """The base as a state records it (a copy): per fragment, where its round was sent
        from while it waits for its merge, else its carry."""
        return torch.cat([f.base_state(i == self.flight) for i, f in enumerate(self.fragments)])

    def restore(self, pending: bool, fragment: int | None, base: torch.Tensor | None) -> None:
        """A loaded state's round and base (:meth:`base_state`; None: zeros): the round in
        flight is dropped; ``pending`` says whether a mean (already in the mean buffer) waits
        for the merge of ``fragment``."""
        self.round.drop()
        self.round.received = pending
        self.flight = fragment if pending else None
        for f in self.fragments:
            f.received = None  # a held round's pieces: the loaded mean is in the mean buffer
        self.base.zero_()
        if base is not None:
            for i, f in enumerate(self.fragments):
                f.load_base(base[f.span.start : f.span.stop], i == self.flight)

    def close(self) -> None:
        self.round.close()
