"""The exchange's pieces: the ordered pipeline, the size cap, the watch on in-flight works."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from gradshare import codec
from gradshare.distributed import _inflight
from gradshare.distributed.exchange import Pipeline, collective, largest_message

from world import spawn


class TestPipeline:
    """Jobs run one at a time in submission order (so every rank issues its collectives in
    one order); after a failure the queued jobs fail at once until the failure is cleared."""

    def test_runs_in_order_in_one_background_thread(self) -> None:
        pipeline = Pipeline("test-pipeline")
        seen: list[tuple[int, str]] = []
        futures = [
            pipeline.submit(lambda i=i: seen.append((i, threading.current_thread().name)) or i)
            for i in range(50)
        ]
        assert [f.wait() for f in futures] == list(range(50))
        assert seen == [(i, "test-pipeline") for i in range(50)]
        pipeline.close()

    def test_failure_fails_the_rest_until_cleared(self) -> None:
        pipeline = Pipeline("test-pipeline")
        gate = threading.Event()
        ran: list[int] = []

        def boom() -> None:
            gate.wait(10)
            raise ValueError("encode failed")

        first = pipeline.submit(boom)
        later = pipeline.submit(lambda: ran.append(1))
        gate.set()
        with pytest.raises(ValueError, match="encode failed"):
            first.wait()
        with pytest.raises(ValueError, match="encode failed"):
            later.wait()
        pipeline.clear_failure()
        assert pipeline.submit(lambda: ran.append(2) or 2).wait() == 2
        assert ran == [2]
        pipeline.close()

    def test_close_ends_the_thread_and_a_submit_starts_another(self) -> None:
        pipeline = Pipeline("test-pipeline-close")
        assert pipeline.submit(lambda: 1).wait() == 1
        pipeline.close()
        names = [t.name for t in threading.enumerate()]
        assert "test-pipeline-close" not in names
        assert pipeline.submit(lambda: 2).wait() == 2
        pipeline.close()


def test_largest_message_is_the_longest_valid_one() -> None:
    """A peer's claimed size is capped here before anything is allocated."""
    for n in (1, 15, 16, 100, 10_000):
        assert largest_message(n) == max(n + 4, n // 16 + 5)
        assert largest_message(n) >= codec.bitmap_length(n)
        assert largest_message(n) >= codec.sparse_length(n)


def _rank_watch(rank: int, world: int) -> dict:
    if rank == 1:
        time.sleep(1.5)  # rank 0's all_gather waits for this rank meanwhile
    mine = torch.full((3,), float(rank))
    table = [torch.empty(3) for _ in range(world)]
    seen: dict = {}
    if rank == 0:
        work = _inflight.issue(lambda: dist.all_gather(table, mine, async_op=True), (table, mine))
        del work  # only the backend holds it now
        seen["while_running"] = _inflight.drain(timeout=0.3)
        seen["watched"] = sorted(id(t) for t in _inflight.watched()) == sorted(
            id(t) for t in [*table, mine]
        )
        seen["after"] = _inflight.drain(timeout=20)
    else:
        collective(dist.all_gather, table, mine, timeout=timedelta(seconds=20), what="x", rank=1)
        seen["after"] = _inflight.drain(timeout=20)
    seen["left"] = len(_inflight.watched())
    seen["table"] = torch.stack(table).tolist()
    held = 0
    for _ in range(50):  # each call returns with its work dropped by the backend
        collective(dist.all_gather, table, mine, timeout=timedelta(seconds=20), what="x", rank=rank)
        held += bool(_inflight.watched())
    seen["held"] = held
    return seen


def test_drain_waits_until_the_backend_drops_the_work() -> None:
    """What lets a rank exit cleanly right after a collective (see gradshare.distributed._inflight):
    the tensors of a collective are watched while its work is in flight, drain() does not return
    True before the backend has dropped it, and does once it has (nothing left watched)."""
    zero, one = (r.get() for r in spawn(_rank_watch, 2))
    assert zero["while_running"] is False and zero["watched"] is True
    assert zero["after"] is True and one["after"] is True
    assert zero["left"] == one["left"] == 0
    assert zero["table"] == one["table"] == [[0.0] * 3, [1.0] * 3]
    # a work still held when the call returned could deadlock a later destroy_process_group
    assert zero["held"] == one["held"] == 0
