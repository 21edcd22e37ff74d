"""LocalSteps' schedule: which fragment syncs and when a round in flight merges, at step s.

Pure arithmetic of the step count (no process group): the fragments' cuts, their sync
offsets, the merges τ steps after a sync, the lead, and the count of syncs a state's
``steps`` holds.
"""

from __future__ import annotations

import pytest

from gradshare.distributed.local_steps.schedule import Schedule


class TestSchedule:
    def test_one_fragment_syncs_every_h_steps(self) -> None:
        s = Schedule([3, 4, 5], sync_every=4, fragments=1, tau=0)
        assert [(x.first, x.last, x.start, x.stop, x.offset) for x in s.spans] == [(0, 3, 0, 12, 0)]
        assert [step for step in range(1, 13) if s.due(step)] == [4, 8, 12]
        assert not any(s.merges(step, 0) for step in range(1, 13))  # τ 0: no rounds in flight

    def test_fragments_of_about_equal_size_spread_over_h(self) -> None:
        """5 fragments of a model whose tensors are 10, 10, 40, 20, 20 elements: cut where
        the running total passes k/5 of 100, every fragment at least one tensor; fragment f
        syncs at the steps ≡ f·H/5 (mod H)."""
        s = Schedule([10, 10, 40, 20, 20], sync_every=10, fragments=5, tau=2)
        assert [(x.first, x.last) for x in s.spans] == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
        assert [x.offset for x in s.spans] == [0, 2, 4, 6, 8]
        assert [x.index for x in s.due(12)] == [1]
        assert [x.index for x in s.due(20)] == [0]
        assert s.due(21) == []

    def test_a_merge_comes_tau_steps_after_its_sync(self) -> None:
        s = Schedule([4, 4], sync_every=4, fragments=2, tau=1)  # syncs at 2, 4, 6, ...
        assert [x.offset for x in s.spans] == [0, 2]
        assert s.merges(5, 0) and not s.merges(5, 1)  # fragment 0 synced at step 4
        assert s.merges(3, 1) and not s.merges(4, 1)  # fragment 1 synced at step 2
        assert not s.merges(5, None)  # nothing in flight

    def test_tau_h_merges_at_the_next_sync_with_a_lead(self) -> None:
        s = Schedule([4], sync_every=4, fragments=1, tau=4)
        assert s.lead
        assert not any(s.merges(step, 0) for step in range(1, 20))
        assert not Schedule([4], sync_every=4, fragments=1, tau=3).lead

    @pytest.mark.parametrize(("h", "parts"), [(1, 1), (4, 1), (10, 5), (7, 3)])
    def test_syncs_by_counts_every_due_step(self, h: int, parts: int) -> None:
        s = Schedule([5] * parts, sync_every=h, fragments=parts, tau=0)
        count = 0
        for step in range(1, 60):
            count += len(s.due(step))
            assert s.syncs_by(step) == count, step
        assert s.syncs_by(0) == 0
