"""The round in flight of ``LocalSteps(overlap=τ)``: its exchange in a background thread.

With overlap, round k's exchange runs while every rank takes the next τ inner steps, and its
mean is merged after them (:class:`~gradshare.LocalSteps` tells the whole story).
:class:`InFlightRound` holds that one round: the background thread, the round's future, what
undoes the round should its exchange fail, and whether its mean waits for the merge. It knows
nothing of the exchange itself: LocalSteps hands it a job.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from gradshare.distributed.exchange import Pipeline
from gradshare.encoding.encoder import EncodeStats

__all__ = ["InFlightRound"]

logger = logging.getLogger(__name__)


class InFlightRound:
    """The round of an overlapping LocalSteps whose exchange runs in the background, then
    its mean until the merge.

    One at a time: :meth:`launch` hands the exchange to a one-thread
    :class:`~gradshare.distributed.exchange.Pipeline`, which then issues the only collectives
    on LocalSteps' private group (LocalSteps issues none before :meth:`wait`); the exchange
    leaves the round's mean in ``LocalSteps._mean``, where it stays (:attr:`received`) until
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
        """A round's mean waits in ``LocalSteps._mean`` for its merge."""
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
