"""The exchange's pieces that need no process group: the ordered pipeline, the size cap."""

from __future__ import annotations

import threading

import pytest

from gradshare import codec
from gradshare.exchange import Pipeline, largest_message


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
