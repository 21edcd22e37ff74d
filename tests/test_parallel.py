"""ParallelWrapper (docs/design.md §6): replicas in sync, dense oracle, conservation, faults,
checkpoints."""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from gradshare import (
    AdaptiveThreshold,
    FixedThreshold,
    ParallelWrapper,
    ResidualClipping,
    StepStats,
    decode_,
)
from gradshare.app.datasets import digits, minibatches, mlp

from toys import flat, logged, toy_batches, toy_model

SGD = lambda params: torch.optim.SGD(params, lr=0.1)


class TestReplicas:
    """Every replica holds the same parameters, bit for bit, after every round."""

    @pytest.mark.parametrize("optimizer", ["sgd", "adam"])
    def test_bit_identical_after_every_round(self, optimizer: str) -> None:
        factory = {
            "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
            "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
        }[optimizer]
        wrapper = ParallelWrapper(
            toy_model(), factory, F.cross_entropy, num_workers=3, threshold=AdaptiveThreshold(1e-3)
        )
        rounds = []

        def check(stats: list[StepStats]) -> None:
            first = flat(wrapper.replicas[0])
            assert all(torch.equal(first, flat(r)) for r in wrapper.replicas[1:])
            rounds.append(len(stats))

        wrapper.fit(toy_batches(20), epochs=2, callback=check)
        assert rounds == [3] * 6 + [2] + [3] * 6 + [2]  # the last partial round works
        assert torch.equal(flat(wrapper.model), flat(wrapper.replicas[0]))
        assert not torch.equal(flat(wrapper.model), flat(toy_model()))  # it did train
        formats = {s.format for s in wrapper.history}
        assert "sparse" in formats or "bitmap" in formats

    def test_dense_mean_equals_single_worker_on_the_union(self) -> None:
        """dense=True, reduction='mean', plain SGD: N workers = one worker on N batches."""
        batches = toy_batches(12, batch=8)
        wrapper = ParallelWrapper(
            toy_model(), SGD, F.cross_entropy, num_workers=3, dense=True, reduction="mean"
        )
        wrapper.fit(batches)
        single = toy_model()
        opt = SGD(single.parameters())
        for r in range(0, 12, 3):
            x = torch.cat([b[0] for b in batches[r : r + 3]])
            y = torch.cat([b[1] for b in batches[r : r + 3]])
            opt.zero_grad()
            F.cross_entropy(single(x), y).backward()
            opt.step()
        torch.testing.assert_close(flat(wrapper.model), flat(single), rtol=1e-5, atol=1e-6)
        assert not torch.allclose(flat(single), flat(toy_model()))

    def test_conservation_per_worker(self) -> None:
        """Σ updates = Σ own messages decoded + residual + clipped, for every worker."""
        wrapper = ParallelWrapper(
            toy_model(),
            SGD,
            F.cross_entropy,
            num_workers=2,
            threshold=FixedThreshold(2e-3),
            post_processor=ResidualClipping(1.0, 3),
        )
        acc = wrapper.accumulator
        n = wrapper.numel
        totals = [torch.zeros(n, dtype=torch.float64) for _ in range(2)]
        clipped_steps = [0, 0]
        store = acc.store_update

        def recording_store(
            party: int, update: torch.Tensor, iteration: int, epoch: int = 0, **kw: bool
        ):
            before = update.double()  # the caller reuses its buffer: copy now
            message = store(party, update, iteration, epoch, **kw)
            totals[party] += before
            if message is not None:
                totals[party] -= decode_(message, torch.zeros(n)).double()
            encoder = acc.encoders[party]  # type: ignore[index]
            gap = totals[party] - encoder.residual.double()
            stats = acc.last_stats[party]
            assert stats is not None
            clipped_steps[party] += stats.clipped > 0
            assert float(gap.abs().sum()) <= sum_clipped[party] + stats.clipped + 1e-6
            sum_clipped[party] += stats.clipped
            return message

        sum_clipped = [0.0, 0.0]
        acc.store_update = recording_store  # type: ignore[method-assign]
        wrapper.fit(toy_batches(30))
        assert all(c > 0 for c in clipped_steps)
        # without clipping the law is exact: run again and compare the gap to zero
        wrapper2 = ParallelWrapper(
            toy_model(), SGD, F.cross_entropy, num_workers=2, threshold=FixedThreshold(2e-3)
        )
        acc2, totals2 = (
            wrapper2.accumulator,
            [torch.zeros(n, dtype=torch.float64) for _ in range(2)],
        )
        store2 = acc2.store_update

        def recording_store2(
            party: int, update: torch.Tensor, iteration: int, epoch: int = 0, **kw: bool
        ):
            totals2[party] += update.double()
            message = store2(party, update, iteration, epoch, **kw)
            if message is not None:
                totals2[party] -= decode_(message, torch.zeros(n)).double()
            return message

        acc2.store_update = recording_store2  # type: ignore[method-assign]
        wrapper2.fit(toy_batches(30))
        assert acc2.encoders is not None
        for p in range(2):
            residual = acc2.encoders[p].residual
            assert residual is not None
            torch.testing.assert_close(totals2[p], residual.double(), rtol=0, atol=1e-6)
            assert residual.abs().max() > 0


class TestFaults:
    def test_a_failing_loss_stops_fit_with_that_error(self) -> None:
        calls = {"n": 0}
        lock = threading.Lock()

        def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with lock:
                calls["n"] += 1
                if calls["n"] == 10:
                    raise ZeroDivisionError("worker loss exploded")
            return F.cross_entropy(out, y)

        before = threading.active_count()
        wrapper = ParallelWrapper(toy_model(), SGD, loss_fn, num_workers=4, timeout=60)
        start = time.monotonic()
        with pytest.raises(ZeroDivisionError, match="worker loss exploded"):
            wrapper.fit(toy_batches(40))
        assert time.monotonic() - start < 30  # the error, not the 60 s timeout
        assert threading.active_count() == before
        wrapper.fit(toy_batches(4))  # usable again afterwards

    @pytest.mark.parametrize(
        ("kwargs", "match"),
        [({"num_workers": 0}, "num_workers"), ({"devices": ["cpu"]}, "one device per worker")],
    )
    def test_bad_arguments(self, kwargs: dict, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            ParallelWrapper(toy_model(), SGD, F.cross_entropy, **kwargs)

    def test_bad_minibatch(self) -> None:
        wrapper = ParallelWrapper(toy_model(), SGD, F.cross_entropy)
        with pytest.raises(TypeError, match=r"\(inputs, targets\)"):
            wrapper.fit([torch.zeros(3)])  # type: ignore[list-item]


class TestCheckpoint:
    def test_resume_mid_epoch_equals_uninterrupted(self, tmp_path: Path) -> None:
        """Save after 4 rounds, restore into a new wrapper, go on: same parameters bit for bit."""
        batches = toy_batches(24)

        def make() -> ParallelWrapper:
            return ParallelWrapper(
                toy_model(),
                lambda p: torch.optim.Adam(p, lr=1e-2),
                F.cross_entropy,
                num_workers=3,
                post_processor=ResidualClipping(),
            )

        whole = make()
        whole.fit(batches)
        first = make()
        first.fit(batches[:12])
        torch.save(first.state_dict(), tmp_path / "ckpt.pt")
        resumed = make()
        resumed.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=False))
        resumed.fit(batches[12:])
        assert torch.equal(flat(resumed.model), flat(whole.model))
        assert resumed.iteration == whole.iteration == 8
        assert resumed.accumulator.bytes_sent == whole.accumulator.bytes_sent


class TestTraining:
    def test_digits_encoded_within_1_5_points_of_dense(self) -> None:
        """A real dataset, 4 workers: encoded sharing trains as well as dense sharing."""
        split = digits(seed=0)
        accuracies = {}
        for name, threshold in (("dense", None), ("encoded", AdaptiveThreshold(1e-3))):
            wrapper = ParallelWrapper(
                mlp(64, 10, hidden=256, seed=1),
                lambda p: torch.optim.SGD(p, lr=0.1),
                F.cross_entropy,
                num_workers=4,
                threshold=threshold,
            )
            for epoch in range(8):
                wrapper.fit(minibatches(split.x_train, split.y_train, 32, seed=epoch))
            result = wrapper.evaluate(minibatches(split.x_test, split.y_test, 256))
            accuracies[name] = result["accuracy"]
            if name == "encoded":
                sent = sum(s.message_bytes for s in wrapper.history)
                dense = sum(s.dense_bytes for s in wrapper.history)
                assert dense / sent > 20
        assert accuracies["dense"] > 0.9
        assert accuracies["encoded"] >= accuracies["dense"] - 0.015, accuracies

    def test_soak_2000_rounds_memory_flat(self) -> None:
        def rss() -> int:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
            raise AssertionError("no VmRSS")

        wrapper = ParallelWrapper(toy_model(), SGD, F.cross_entropy, num_workers=2)
        batches = toy_batches(100)
        wrapper.fit(batches * 2)  # warm up: kernels, allocator pools
        start = rss()
        for _ in range(19):
            wrapper.fit(batches * 2)
            wrapper.history.clear()
        assert wrapper.iteration == 2000
        assert rss() < start * 1.05, (start, rss())


def test_model_untouched_until_fit_ends() -> None:
    model = toy_model()
    saved = copy.deepcopy(model)
    wrapper = ParallelWrapper(model, SGD, F.cross_entropy, num_workers=2)
    assert torch.equal(flat(model), flat(saved))
    wrapper.fit(toy_batches(4))
    assert not torch.equal(flat(model), flat(saved))


def test_fit_draws_no_progress_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    """The library draws no bar (fit made a tqdm bar of its own): bars belong to the CLI, or to
    a `callback`."""
    import tqdm.auto

    def no_bar(*args: object, **kwargs: object) -> None:
        raise AssertionError("ParallelWrapper.fit made a progress bar")

    monkeypatch.setattr(tqdm.auto, "tqdm", no_bar)
    seen: list[int] = []
    wrapper = ParallelWrapper(toy_model(), SGD, F.cross_entropy, num_workers=2)
    wrapper.fit(toy_batches(8), callback=lambda stats: seen.append(len(stats)))
    assert seen == [2, 2, 2, 2]


def test_logs_its_configuration_and_each_round_at_debug() -> None:
    """ParallelWrapper said nothing of itself: one INFO line when built, a DEBUG line a round."""
    with logged("gradshare.local") as said:
        wrapper = ParallelWrapper(toy_model(), SGD, F.cross_entropy, num_workers=2)
        wrapper.fit(toy_batches(4))
    assert [level for level, _ in said] == ["INFO", "DEBUG", "DEBUG"], said
    assert said[0][1].startswith("ParallelWrapper: 2 workers on ['cpu']"), said
    assert said[2][1].startswith("ParallelWrapper round 1: 2 workers sent "), said
