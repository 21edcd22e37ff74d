"""EncodedGradientsAccumulator (docs/design.md §5): rounds, party order, conservation, errors,
state."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from gradshare import (
    AccumulatorError,
    EncodedGradientsAccumulator,
    FixedThreshold,
    IndexedTail,
    ResidualClipping,
    decode_,
)


def run_parties(fns: list[Callable[[], Any]], timeout: float = 20) -> list[Any]:
    """Run one callable per party in its own thread; return results or the exceptions raised."""
    results: list[Any] = [None] * len(fns)

    def body(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as e:
            results[i] = e

    threads = [threading.Thread(target=body, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a party hung"
    return results


def updates(num_parties: int, n: int, rounds: int, seed: int = 0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(n, generator=g) * 1e-2 for _ in range(num_parties)] for _ in range(rounds)]


class TestRound:
    """One round: every party applies the same Σ of decoded messages, in party order."""

    def test_exact_sum_of_every_party(self) -> None:
        acc = EncodedGradientsAccumulator(3, threshold=FixedThreshold(1.0))
        ups = [torch.tensor([2.0, 0.0, -1.5, 1.0]), torch.tensor([0.0, 3.0, 1.0, -1.0])]
        ups.append(torch.tensor([1.0, 1.0, 1.0, 1.0]))
        params = [torch.zeros(4) for _ in range(3)]

        def party(p: int) -> Callable[[], int]:
            return lambda: (acc.store_update(p, ups[p], 0), acc.apply_update(p, params[p]))[1]

        assert run_parties([party(p) for p in range(3)]) == [3, 3, 3]
        for p in range(3):  # each moved ±1 per element with |u| >= 1
            assert params[p].tolist() == [-2.0, -2.0, -1.0, -1.0]
        assert acc.encoders is not None
        assert acc.encoders[0].residual.tolist() == [1.0, 0.0, -0.5, 0.0]  # type: ignore[union-attr]
        # (N < 48 always goes bitmap, which moves ±t for |x| >= t, as sparse would here)
        assert not acc.has_anything(0)

    def test_replicas_bit_identical_whatever_the_arrival_order(self) -> None:
        """Messages arrive in random order; decoding in party order keeps replicas equal."""
        n, k = 5000, 4
        acc = EncodedGradientsAccumulator(k, threshold=FixedThreshold(5e-3))
        ups = updates(k, n, 6)
        params = [torch.ones(n) for _ in range(k)]

        def party(p: int) -> Callable[[], None]:
            def body() -> None:
                for r, row in enumerate(ups):
                    time.sleep(0.001 * ((p * 7 + r * 3) % 5))  # vary who arrives first
                    acc.store_update(p, row[p], r)
                    acc.apply_update(p, params[p])

            return body

        assert run_parties([party(p) for p in range(k)]) == [None] * k
        reference = torch.ones(n)
        encoders = EncodedGradientsAccumulator(k, threshold=FixedThreshold(5e-3)).encoders
        assert encoders is not None
        for r, row in enumerate(ups):
            buffer = torch.zeros(n)
            for p in range(k):
                msg = encoders[p].encode(row[p], r)
                if msg is not None:
                    decode_(msg, buffer)
            reference -= buffer
        for p in range(k):
            assert torch.equal(params[p], reference)

    def test_mean_reduction_and_dense_mode(self) -> None:
        acc = EncodedGradientsAccumulator(2, dense=True, reduction="mean")
        ups = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, -4.0])]
        params = [torch.zeros(2), torch.zeros(2)]
        run_parties(
            [
                lambda p=p: (acc.store_update(p, ups[p], 0), acc.apply_update(p, params[p]))
                for p in (0, 1)
            ]  # type: ignore[misc]
        )
        assert params[0].tolist() == params[1].tolist() == [-2.0, 1.0]
        assert acc.bytes_sent == [8, 8]

    def test_conservation_per_party_with_clipping(self) -> None:
        """Per party and step: Σ updates - Σ own messages decoded - residual = clipped mass.

        The clipped mass is reported per step as an L1 norm, so the test checks each step's
        change of the gap against that step's figure.
        """
        n, k, rounds = 3000, 3, 30
        acc = EncodedGradientsAccumulator(
            k, threshold=FixedThreshold(4e-3), post_processor=ResidualClipping(1.0, 4)
        )
        ups = updates(k, n, rounds, seed=3)
        params = [torch.zeros(n) for _ in range(k)]
        checked = [0] * k

        def party(p: int) -> Callable[[], None]:
            def body() -> None:
                total = torch.zeros(n, dtype=torch.float64)
                last_gap = torch.zeros(n, dtype=torch.float64)
                assert acc.encoders is not None
                for r in range(rounds):
                    total += ups[r][p].double()
                    msg = acc.store_update(p, ups[r][p], r)
                    if msg is not None:
                        total -= decode_(msg, torch.zeros(n)).double()
                    residual = acc.encoders[p].residual
                    stats = acc.last_stats[p]
                    assert residual is not None and stats is not None
                    gap = total - residual.double()
                    step = float((gap - last_gap).abs().sum())
                    assert step == pytest.approx(stats.clipped, rel=1e-4, abs=1e-4)
                    checked[p] += stats.clipped > 0
                    last_gap = gap
                    acc.apply_update(p, params[p])

            return body

        assert run_parties([party(p) for p in range(k)]) == [None] * k
        assert all(c > 0 for c in checked)  # the clipping path was exercised
        assert all(torch.equal(params[0], x) for x in params)

    def test_idle_party_applies_the_round_later(self) -> None:
        acc = EncodedGradientsAccumulator(3, threshold=FixedThreshold(1.0))
        acc.register_consumers(2)
        params = [torch.zeros(2) for _ in range(3)]
        run_parties(
            [
                lambda p=p: (  # type: ignore[misc]
                    acc.store_update(p, torch.tensor([2.0, -2.0]), 0),
                    acc.apply_update(p, params[p]),
                )
                for p in (0, 1)
            ]
        )
        assert acc.has_anything(2)
        assert acc.apply_update(2, params[2]) == 2
        assert params[2].tolist() == params[0].tolist() == [-2.0, 2.0]

    def test_external_source_is_applied(self) -> None:
        acc = EncodedGradientsAccumulator(1, threshold=FixedThreshold(1.0))
        acc.fallback_to_single_consumer_mode(True)
        tail = IndexedTail(1)
        tail.put(torch.tensor([0.5, 0.25]))
        acc.set_external_source(tail)
        assert acc.has_anything(0)
        params = torch.zeros(2)
        acc.store_update(0, torch.tensor([1.0, 1.0]), 0)
        assert acc.apply_update(0, params) == 1
        assert params.tolist() == [-1.5, -1.25]
        assert tail.updates_size() == 0

    def test_params_as_a_list_of_tensors(self) -> None:
        acc = EncodedGradientsAccumulator(1, threshold=FixedThreshold(1.0))
        acc.fallback_to_single_consumer_mode(True)
        acc.store_update(0, torch.tensor([1.0, -1.0, 2.0, 0.0, 1.0, 1.0]), 0)
        w, b = torch.zeros(2, 2), torch.zeros(2)
        acc.apply_update(0, [w, b])
        assert w.tolist() == [[-1.0, 1.0], [-1.0, 0.0]] and b.tolist() == [-1.0, -1.0]


class TestFaults:
    """A failing party never leaves the others waiting: they raise with its error attached."""

    def test_failure_wakes_waiting_parties_long_before_the_timeout(self) -> None:
        """Woken by the failure (0.2 s in), not by the 60 s timeout; the bound leaves room for
        a loaded machine."""
        acc = EncodedGradientsAccumulator(3, threshold=FixedThreshold(1.0), timeout=60)
        bad = torch.tensor([1.0, float("nan")])

        def waiting(p: int) -> Callable[[], float]:
            def body() -> float:
                start = time.monotonic()
                try:
                    acc.store_update(p, torch.ones(2), 0)
                finally:
                    elapsed = time.monotonic() - start
                return elapsed

            return body

        def failing() -> None:
            time.sleep(0.2)
            acc.store_update(2, bad, 0)

        start = time.monotonic()
        results = run_parties([waiting(0), waiting(1), failing])
        assert time.monotonic() - start < 10
        assert isinstance(results[2], ValueError) and "non-finite" in str(results[2])
        for r in results[:2]:
            assert isinstance(r, AccumulatorError)
            assert r.__cause__ is results[2] and "party 2 failed" in str(r)
        with pytest.raises(AccumulatorError):  # later calls fail too, until reset()
            acc.apply_update(0, torch.zeros(2))
        assert acc.encoders is not None and acc.encoders[2].residual is not None
        assert acc.encoders[2].residual.tolist() == [0.0, 0.0]  # the bad update changed nothing
        acc.reset()
        acc.register_consumers(1)
        acc.store_update(0, torch.ones(2), 1)

    def test_timeout_when_a_party_never_comes(self) -> None:
        acc = EncodedGradientsAccumulator(2, threshold=FixedThreshold(1.0), timeout=0.3)
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"waited 0\.3 s for 2 parties"):
            acc.store_update(0, torch.ones(2), 0)
        assert time.monotonic() - start < 2
        with pytest.raises(AccumulatorError, match="party 0 failed"):
            acc.store_update(1, torch.ones(2), 0)

    def test_full_queue_is_a_clear_error(self) -> None:
        acc = EncodedGradientsAccumulator(2, threshold=FixedThreshold(1.0), queue_size=1)
        acc.fallback_to_single_consumer_mode(True)
        for i in range(2):  # party 1 never applies: its queue fills with 2 messages
            acc.store_update(0, torch.full((4,), 2.0), i)
            acc.apply_update(0, torch.zeros(4))
        with pytest.raises(RuntimeError, match="optimal_buffer_size"):
            acc.store_update(0, torch.full((4,), 2.0), 2)

    def test_wrong_params_size_leaves_queue_and_params(self) -> None:
        acc = EncodedGradientsAccumulator(1, threshold=FixedThreshold(1.0))
        acc.fallback_to_single_consumer_mode(True)
        acc.store_update(0, torch.full((4,), 2.0), 0)
        params = torch.zeros(3)
        with pytest.raises(ValueError, match="another vector"):
            acc.apply_update(0, params)
        assert params.tolist() == [0.0] * 3 and acc.has_anything(0)
        acc.reset()
        good = torch.zeros(4)
        acc.store_update(0, torch.full((4,), 2.0), 1)
        assert acc.apply_update(0, good) == 1

    @pytest.mark.parametrize(
        ("kwargs", "match"),
        [
            ({"num_parties": 0}, "num_parties"),
            ({"num_parties": 2, "reduction": "avg"}, "reduction"),
            ({"num_parties": 2, "queue_size": 0}, "queue_size"),
            ({"num_parties": 2, "timeout": -1}, "timeout"),
            ({"num_parties": 2, "timeout": float("inf")}, "infinite"),
        ],
    )
    def test_bad_arguments(self, kwargs: dict[str, Any], match: str) -> None:
        with pytest.raises(ValueError, match=match):
            EncodedGradientsAccumulator(**kwargs)

    def test_bad_party_and_consumers(self) -> None:
        acc = EncodedGradientsAccumulator(2)
        with pytest.raises(ValueError, match="party"):
            acc.store_update(2, torch.ones(2), 0)
        with pytest.raises(ValueError, match=r"1\.\.2"):
            acc.register_consumers(3)


class TestState:
    def test_round_trip_continues_bit_for_bit(self) -> None:
        n = 2000
        ups = updates(1, n, 12, seed=5)

        def make() -> EncodedGradientsAccumulator:
            acc = EncodedGradientsAccumulator(1)
            acc.fallback_to_single_consumer_mode(True)
            return acc

        a, params_a = make(), torch.zeros(n)
        for r in range(12):
            a.store_update(0, ups[r][0], r)
            a.apply_update(0, params_a)
        b, params_b = make(), torch.zeros(n)
        for r in range(6):
            b.store_update(0, ups[r][0], r)
            b.apply_update(0, params_b)
        c = make()
        c.load_state_dict(b.state_dict())
        for r in range(6, 12):
            c.store_update(0, ups[r][0], r)
            c.apply_update(0, params_b)
        assert torch.equal(params_a, params_b)
        assert a.bytes_sent == c.bytes_sent

    def test_mismatched_state_is_refused(self) -> None:
        with pytest.raises(ValueError, match="same settings"):
            EncodedGradientsAccumulator(3).load_state_dict(
                EncodedGradientsAccumulator(2).state_dict()
            )
