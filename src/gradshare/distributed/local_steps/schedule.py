"""When each fragment syncs and when a round in flight merges: arithmetic of the step count.

Nothing here touches a tensor or a process group, so the schedule is tested on its own
(tests/test_local_steps_schedule.py).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

__all__ = ["Schedule", "Span"]


@dataclass(frozen=True, slots=True)
class Span:
    """Where a fragment lies (Streaming DiLoCo's fragment: a run of parameters synced
    together) and when it syncs."""

    index: int
    first: int
    """Its parameters: ``params[first:last]``."""
    last: int
    start: int
    """Its elements in the model's flat order: ``[start, stop)``."""
    stop: int
    offset: int
    """It syncs at the steps ≡ ``offset`` (mod ``sync_every``); 0 for the first."""

    @property
    def numel(self) -> int:
        return self.stop - self.start


class Schedule:
    """The fragments of a model and the steps at which each syncs and merges.

    Args:
        sizes: every parameter's number of elements, in order.
        sync_every: H, the steps between two syncs of a fragment.
        fragments: how many fragments, runs of consecutive parameters of about equal size
            whose syncs are spread evenly over the H steps.
        tau: the steps a round's exchange runs in the background before its merge (0: none;
            ``sync_every``: the merge comes at the next sync, with a lead).
    """

    __slots__ = ("spans", "sync_every", "tau")

    def __init__(self, sizes: list[int], sync_every: int, fragments: int, tau: int) -> None:
        self.sync_every = sync_every
        self.tau = tau
        self.spans = _partition(sizes, fragments, sync_every)

    @property
    def lead(self) -> bool:
        """τ = ``sync_every`` (one fragment): each merge comes at the next sync, with a lead."""
        return self.tau == self.sync_every

    def due(self, step: int) -> list[Span]:
        """The fragments whose sync ends inner step ``step`` (counted from 1)."""
        return [s for s in self.spans if step % self.sync_every == s.offset]

    def merges(self, step: int, flight: int | None) -> bool:
        """Whether step ``step`` merges the round of fragment ``flight`` in flight (τ steps
        after its sync; with a lead, never on its own: the next sync merges it)."""
        if flight is None or self.lead or not self.tau:
            return False
        return (step - self.tau) % self.sync_every == self.spans[flight].offset

    def syncs_by(self, steps: int) -> int:
        """How many syncs the first ``steps`` inner steps end with (every fragment's)."""
        h = self.sync_every
        return sum(
            0 if steps < s.offset else (steps - s.offset) // h + (s.offset > 0) for s in self.spans
        )


def _partition(sizes: list[int], parts: int, sync_every: int) -> list[Span]:
    """``parts`` runs of consecutive parameters with about equal elements each, their syncs
    spread evenly over the ``sync_every`` steps."""
    cum = list(itertools.accumulate(sizes))
    cuts = [0]
    for k in range(1, parts):
        i = bisect.bisect_left(cum, k * cum[-1] / parts) + 1
        cuts.append(min(max(i, cuts[-1] + 1), len(sizes) - (parts - k)))
    cuts.append(len(sizes))
    starts = [0, *cum]
    return [
        Span(k, cuts[k], cuts[k + 1], starts[cuts[k]], starts[cuts[k + 1]], k * sync_every // parts)
        for k in range(parts)
    ]
