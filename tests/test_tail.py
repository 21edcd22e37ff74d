"""IndexedTail (docs/design.md §5): per-consumer positions, freeing, collapsing, concurrent use."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from gradshare import IndexedTail, MessageError, encode_sparse_
from gradshare.local.tail import COLLAPSE_AT


def _full(n: int, value: float) -> torch.Tensor:
    return torch.full((n,), float(value))


class TestPositions:
    """Each consumer reads every entry exactly once, in arrival order, from its own position."""

    def test_delta_sequence(self) -> None:
        tail = IndexedTail(2, numel=5)
        assert tail.delta(0) == tail.delta(1) == 0 and not tail.has_anything(0)
        tail.put(_full(5, 1))
        assert tail.delta(0) == tail.delta(1) == 1
        tail.put(_full(5, 2))
        tail.put(_full(5, 3))
        assert tail.delta(0) == 3 and tail.has_anything(1)
        target = torch.zeros(5)
        assert tail.drain_to(0, target) and target.tolist() == [6.0] * 5
        assert tail.delta(0) == 0 and tail.delta(1) == 3
        tail.put(_full(5, 4))
        assert tail.delta(0) == 1 and tail.delta(1) == 4
        target = torch.zeros(5)
        assert tail.drain_to(0, target) is True  # one new entry: True, and it is added
        assert target.tolist() == [4.0] * 5 and tail.delta(0) == 0 and tail.delta(1) == 4
        untouched = torch.full((5,), 7.0)
        assert tail.drain_to(0, untouched) is False  # nothing new: False, target untouched
        assert untouched.tolist() == [7.0] * 5 and tail.delta(1) == 4

    def test_maintenance_frees_what_all_read(self) -> None:
        tail = IndexedTail(2)
        for i in range(5):
            tail.put(_full(3, i))
        tail.drain_to(0, torch.zeros(3))
        assert tail.updates_size() == 5  # consumer 1 has read nothing
        tail.drain_to(1, torch.zeros(3))
        assert tail.updates_size() == 0
        tail.put(_full(3, 7))
        assert tail.updates_size() == 1 and tail.delta(0) == tail.delta(1) == 1
        tail.purge()
        assert tail.updates_size() == 0 and tail.delta(0) == 0

    def test_encoded_and_dense_entries_mix(self) -> None:
        tail = IndexedTail(1, numel=4)
        msg = encode_sparse_(torch.tensor([2.0, 0.0, -2.0, 0.5]), 1.0)
        assert msg is not None
        tail.put(msg)
        tail.put(torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64))
        target = torch.zeros(4)
        tail.drain_to(0, target)
        assert target.tolist() == [1.25, 0.25, -0.75, 0.25]

    def test_bad_input_leaves_tail_unchanged(self) -> None:
        tail = IndexedTail(1, numel=4)
        msg = encode_sparse_(torch.tensor([2.0, 0.0, -2.0, 0.5]), 1.0)
        assert msg is not None
        msg[-1] = 1  # not ascending: |1| after |1|
        with pytest.raises(MessageError, match="ascending"):
            tail.put(msg)
        with pytest.raises(ValueError, match="4 elements"):
            tail.put(torch.zeros(5))
        with pytest.raises(MessageError, match="another vector"):
            tail.put(encode_sparse_(torch.tensor([2.0, 2.0, 0.0]), 1.0))  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="consumer"):
            tail.delta(1)
        with pytest.raises(ValueError, match="4 elements"):
            tail.drain_to(0, torch.zeros(3))
        assert tail.updates_size() == 0


class TestCollapse:
    """With collapsing on, a put sums the entries nobody has read into one dense entry.

    The unread-by-everyone part of the tail stays at most :data:`COLLAPSE_AT` entries however
    long nobody drains, and every consumer drains exactly the totals it would without it.
    """

    def test_64_puts_collapse_to_one_holding_2080(self) -> None:
        """DL4J's testSingleThreaded_3: collapsing happens on put, not only on a drain."""
        tail = IndexedTail(2, allow_collapse=True, numel=25)
        for i in range(1, 65):
            tail.put(_full(25, i))
        assert tail.updates_size() == 1
        assert tail.delta(0) == tail.delta(1) == 1
        assert not tail.maybe_collapse()  # nothing left to do
        for consumer in range(2):
            target = torch.zeros(25)
            assert tail.drain_to(consumer, target)
            assert target.tolist() == [2080.0] * 25
        assert tail.updates_size() == 0

    def test_memory_stays_bounded_while_nobody_drains(self) -> None:
        tail = IndexedTail(1, allow_collapse=True, numel=3)
        sizes = []
        for i in range(1, 1001):
            tail.put(_full(3, i))
            sizes.append(tail.updates_size())
        assert max(sizes) == COLLAPSE_AT - 1 and sizes[-1] == 1
        target = torch.zeros(3)
        tail.drain_to(0, target)
        assert target.tolist() == [500500.0] * 3

    def test_collapse_again_after_a_read_and_mixed_entries(self) -> None:
        """A read ends merging into the collapsed entry; later puts pile up and collapse anew.
        Messages and dense vectors alike; totals equal those of a tail without collapsing."""
        on, off = IndexedTail(2, allow_collapse=True), IndexedTail(2)
        totals = {(tail, c): torch.zeros(4) for tail in (on, off) for c in range(2)}
        for i in range(200):
            x = torch.tensor([float(i % 5), -2.0, 0.0, 1.0])
            msg = encode_sparse_(x.clone(), 1.0)
            assert msg is not None
            for tail in (on, off):
                tail.put(msg if i % 3 else x)
            if i % 70 == 69:
                on.drain_to(0, totals[on, 0])
                off.drain_to(0, totals[off, 0])
        # one collapsed entry per stretch between consumer 0's reads, each read by it only
        assert on.updates_size() == 3 and off.updates_size() == 200
        for tail in (on, off):
            for c in range(2):
                tail.drain_to(c, totals[tail, c])
        for c in range(2):
            assert torch.equal(totals[on, c], totals[off, c])
        assert torch.equal(totals[on, 0], totals[on, 1])

    def test_no_collapse_below_threshold_or_when_off(self) -> None:
        on, off = IndexedTail(1, allow_collapse=True), IndexedTail(1)
        for i in range(COLLAPSE_AT - 1):
            on.put(_full(2, i))
            off.put(_full(2, i))
        off.put(_full(2, 0))
        assert not on.maybe_collapse() and on.updates_size() == COLLAPSE_AT - 1
        assert not off.maybe_collapse() and off.updates_size() == COLLAPSE_AT
        on.put(_full(2, 0))
        assert on.updates_size() == 1

    def test_maybe_collapse_after_switching_on(self) -> None:
        tail = IndexedTail(1)
        for i in range(1, 41):
            tail.put(_full(2, i))
        tail.allow_collapse = True
        assert tail.maybe_collapse() and tail.updates_size() == 1
        target = torch.zeros(2)
        tail.drain_to(0, target)
        assert target.tolist() == [820.0, 820.0]

    def test_collapse_spares_entries_a_consumer_has_read(self) -> None:
        """A consumer ahead of another must not read the collapsed entries twice."""
        tail = IndexedTail(2, allow_collapse=True)
        for i in range(1, 11):
            tail.put(_full(2, i))
        ahead = torch.zeros(2)
        tail.drain_to(0, ahead)  # consumer 0 read 1..10 (55), consumer 1 nothing
        for i in range(11, 51):
            tail.put(_full(2, i))
        assert tail.updates_size() == 11  # 10 read by consumer 0 only, plus the collapsed 40
        tail.drain_to(0, ahead)
        behind = torch.zeros(2)
        tail.drain_to(1, behind)
        assert ahead.tolist() == behind.tolist() == [1275.0, 1275.0]  # 1 + ... + 50
        assert tail.updates_size() == 0


def _writer_update(n: int, w: int, i: int) -> torch.Tensor:
    x = torch.zeros(n)
    a = (w * 16 + i * 5) % n
    x[a] = 2.0
    x[(a + n // 2) % n] = -3.0  # never the same element
    return x


class TestConcurrency:
    def test_four_writers_four_readers_each_read_the_full_sum(self) -> None:
        """Every reader ends with exactly the sum of all puts, encoded and dense alike."""
        n, per_writer = 64, 50
        tail = IndexedTail(4, allow_collapse=True, numel=n)
        done = threading.Event()
        totals = [torch.zeros(n) for _ in range(4)]
        errors: list[BaseException] = []

        def write(w: int) -> None:
            try:
                for i in range(per_writer):
                    x = _writer_update(n, w, i)
                    msg = encode_sparse_(x.clone(), 1.0)  # moves ±1 where |x| >= 1: exact
                    assert msg is not None
                    tail.put(msg if i % 2 else x.clamp(-1, 1))
            except BaseException as e:
                errors.append(e)

        def read(c: int) -> None:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                finished = done.is_set()
                tail.drain_to(c, totals[c])
                if finished and not tail.has_anything(c):
                    return
            errors.append(TimeoutError(f"reader {c} did not finish"))

        writers = [threading.Thread(target=write, args=(w,)) for w in range(4)]
        readers = [threading.Thread(target=read, args=(c,)) for c in range(4)]
        for t in writers + readers:
            t.start()
        for t in writers:
            t.join(20)
        done.set()
        for t in readers:
            t.join(25)
        assert not errors, errors
        expected = torch.zeros(n)
        for w in range(4):
            for i in range(per_writer):
                expected += _writer_update(n, w, i).clamp(-1, 1)
        for total in totals:
            assert torch.equal(total, expected)
        assert tail.updates_size() == 0
