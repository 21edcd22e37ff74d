"""Threshold algorithms (docs/design.md §2): DL4J's sequences, validation, state, averaging."""

from __future__ import annotations

import pytest
import torch

from gradshare import AdaptiveThreshold, FixedThreshold, TargetDensityThreshold
from gradshare.encoding.threshold import DEFAULT_DECAY, THRESHOLD_SPAN, ThresholdAlgorithm


class TestAdaptive:
    """AdaptiveThreshold follows DL4J's AdaptiveThresholdAlgorithm call for call."""

    def test_dl4j_sequence(self) -> None:
        """DL4J's test: (1e-3, 1e-3, 1e-2, 0.95) -> 1e-3, /0.95 (dense), /0.95, *0.95."""
        a = AdaptiveThreshold(1e-3, 1e-3, 1e-2, 0.95)
        t1 = a.calculate_threshold(0, 0, None, None, None)
        assert t1 == 1e-3
        t2 = a.calculate_threshold(1, 0, t1, True, None)
        assert t2 == 1e-3 / 0.95
        t3 = a.calculate_threshold(2, 0, t2, False, 0.1)
        assert t3 == t2 / 0.95
        t4 = a.calculate_threshold(3, 0, t3, False, 1e-4)
        assert t4 == t3 * 0.95

    def test_inside_band_unchanged_and_stored_base(self) -> None:
        a = AdaptiveThreshold(2e-3)
        assert a.calculate_threshold(0, 0, None, None, None) == 2e-3
        assert a.calculate_threshold(1, 0, None, False, 1e-3) == 2e-3
        assert a.calculate_threshold(2, 0, None, False, 1e-5) == 2e-3 * DEFAULT_DECAY

    def test_stored_density_used_when_none_given(self) -> None:
        a = AdaptiveThreshold(1.0)
        a.calculate_threshold(0, 0, None, None, None)
        a.calculate_threshold(1, 0, None, False, 0.5)  # above: /decay, stores 0.5
        assert a.calculate_threshold(2, 0, 1.0, False, None) == 1.0 / DEFAULT_DECAY

    def test_default_decay_value(self) -> None:
        assert DEFAULT_DECAY == 0.9659363289248456
        assert AdaptiveThreshold().decay == DEFAULT_DECAY

    @pytest.mark.parametrize(
        "kwargs,match",
        [
            ({"initial": 0.0}, "initial"),
            ({"initial": float("nan")}, "initial"),
            ({"min_density": 0.0}, "min_density"),
            ({"min_density": 0.1, "max_density": 0.01}, "swap"),
            ({"decay": 1.0}, "decay"),
            ({"decay": 0.4}, "decay"),
        ],
    )
    def test_validation(self, kwargs: dict[str, float], match: str) -> None:
        with pytest.raises(ValueError, match=match):
            AdaptiveThreshold(**kwargs)


def _zero_steps(a: ThresholdAlgorithm, steps: int, t: float | None = None) -> float:
    """Feed ``steps`` messages that sent nothing (density 0); return the last threshold."""
    if t is None:
        t = a.calculate_threshold(0, 0, None, None, None)
    for i in range(steps):
        t = a.calculate_threshold(i + 1, 0, t, False, 0.0)
    return t


class TestBounds:
    """t stays within [min_threshold, max_threshold]; without it, steps that send nothing
    shrank it without end (1,500 of them: 2.7e-26, then ~1,500 steps to climb back)."""

    @pytest.mark.parametrize("cls", [AdaptiveThreshold, TargetDensityThreshold])
    def test_zero_steps_stop_at_the_floor_and_recover_fast(self, cls: type) -> None:
        a = cls(1e-4)
        assert a.min_threshold == 1e-4 / THRESHOLD_SPAN and a.max_threshold == 1e-4 * 1e6
        t = _zero_steps(a, 1500)
        assert t == a.min_threshold == pytest.approx(1e-10)
        steps = 0
        while t < 1e-4:
            t = a.calculate_threshold(steps, 0, t, True, None)  # bitmaps: too dense, t rises
            steps += 1
        assert steps <= 400

    @pytest.mark.parametrize("cls", [AdaptiveThreshold, TargetDensityThreshold])
    def test_explicit_bounds_clamp_both_ways(self, cls: type) -> None:
        a = cls(1e-3, min_threshold=5e-4, max_threshold=2e-3)
        assert _zero_steps(a, 100) == 5e-4
        t = a.calculate_threshold(1, 0, None, None, None)
        for i in range(100):
            t = a.calculate_threshold(i, 0, t, True, None)
        assert t == 2e-3
        assert a.calculate_threshold(0, 0, 1.0, False, 1e-3) == 2e-3  # a given t is bounded too

    def test_bounds_never_bind_in_the_band(self) -> None:
        """Inside the defaults the DL4J sequence is unchanged (see TestAdaptive)."""
        a = AdaptiveThreshold(1e-3)
        expected = 1e-3
        for _ in range(300):
            expected *= DEFAULT_DECAY
        assert _zero_steps(a, 300) == expected > a.min_threshold

    @pytest.mark.parametrize(
        "kwargs,match",
        [
            ({"min_threshold": 0.0}, "min_threshold"),
            ({"max_threshold": float("inf")}, "max_threshold"),
            ({"min_threshold": 2e-3}, "<= `initial` <="),
            ({"max_threshold": 5e-4}, "<= `initial` <="),
        ],
    )
    @pytest.mark.parametrize("cls", [AdaptiveThreshold, TargetDensityThreshold])
    def test_validation(self, cls: type, kwargs: dict[str, float], match: str) -> None:
        with pytest.raises(ValueError, match=match):
            cls(1e-3, **kwargs)

    def test_in_state_dict_and_clone(self) -> None:
        a = AdaptiveThreshold(1e-3, min_threshold=1e-5, max_threshold=1e-1)
        settings = a.state_dict()["settings"]
        assert settings["min_threshold"] == 1e-5 and settings["max_threshold"] == 1e-1
        b = a.clone()
        assert isinstance(b, AdaptiveThreshold) and b.settings() == a.settings()
        with pytest.raises(ValueError, match="settings"):
            AdaptiveThreshold(1e-3).load_state_dict(a.state_dict())
        c = AdaptiveThreshold(1e-3, min_threshold=1e-5, max_threshold=1e-1)
        c.load_state_dict(a.state_dict())


class TestTargetDensity:
    def test_rules(self) -> None:
        a = TargetDensityThreshold(1.0, 1e-3, 0.5)
        assert a.calculate_threshold(0, 0, None, None, None) == 1.0
        assert a.calculate_threshold(1, 0, 1.0, False, 1e-4) == 0.5
        assert a.calculate_threshold(2, 0, 0.5, False, 1e-2) == 1.0
        assert a.calculate_threshold(3, 0, 1.0, False, 1e-3) == 1.0
        assert a.calculate_threshold(4, 0, 1.0, True, None) == 2.0

    def test_checkpoints_of_the_old_names_load(self) -> None:
        """gradshare 0.1 called density "sparsity" (DL4J's word): its states still load."""
        a = TargetDensityThreshold(1e-3, 2e-3)
        a.calculate_threshold(0, 0, None, None, None)
        a.calculate_threshold(1, 0, 1e-3, False, 5e-3)
        old = {
            "class": "TargetSparsityThreshold",
            "settings": a.settings(),
            "last_threshold": a.last_threshold,
            "last_sparsity": a.last_density,
        }
        b = TargetDensityThreshold(1e-3, 2e-3)
        b.load_state_dict(old)
        assert b.state_dict() == a.state_dict()
        band = AdaptiveThreshold(1e-3, 1e-4, 1e-2)
        saved = band.state_dict()
        saved["settings"] = {
            k.replace("density", "sparsity"): v for k, v in saved["settings"].items()
        }
        AdaptiveThreshold(1e-3, 1e-4, 1e-2).load_state_dict(saved)

    @pytest.mark.parametrize("target", [0.0, 1 / 16, 0.5])
    def test_target_validation(self, target: float) -> None:
        with pytest.raises(ValueError, match="target"):
            TargetDensityThreshold(target=target)


class TestFixed:
    def test_always_same(self) -> None:
        f = FixedThreshold(0.25)
        assert [f.calculate_threshold(i, 0, 9.0, True, 0.5) for i in range(3)] == [0.25] * 3

    @pytest.mark.parametrize("t", [0.0, -1.0, float("inf")])
    def test_validation(self, t: float) -> None:
        with pytest.raises(ValueError, match="threshold"):
            FixedThreshold(t)


def _run(a: ThresholdAlgorithm, sparsities: list[float | None]) -> list[float]:
    out, last = [], None
    for i, s in enumerate(sparsities):
        last = a.calculate_threshold(i, 0, last, s is None and i > 0, s)
        out.append(last)
    return out


class TestState:
    """A restored algorithm continues exactly as the original would have."""

    @pytest.mark.parametrize(
        "make",
        [
            lambda: AdaptiveThreshold(1e-3),
            lambda: TargetDensityThreshold(1e-3),
            lambda: FixedThreshold(1e-3),
        ],
    )
    def test_round_trip_continues_identically(self, make) -> None:  # type: ignore[no-untyped-def]
        seq = [None, 0.5, None, 1e-5, 1e-3, 0.2]
        a = make()
        _run(a, seq[:3])
        b = make()
        b.load_state_dict(a.state_dict())
        assert [a.calculate_threshold(9, 1, None, False, s) for s in seq[3:]] == [
            b.calculate_threshold(9, 1, None, False, s) for s in seq[3:]
        ]

    def test_load_rejects_other_class_and_settings(self) -> None:
        with pytest.raises(ValueError, match="AdaptiveThreshold"):
            FixedThreshold(1.0).load_state_dict(AdaptiveThreshold().state_dict())
        with pytest.raises(ValueError, match="settings"):
            AdaptiveThreshold(1e-3).load_state_dict(AdaptiveThreshold(2e-3).state_dict())

    def test_clone_is_independent(self) -> None:
        a = AdaptiveThreshold(1.0)
        a.calculate_threshold(0, 0, None, None, None)
        b = a.clone()
        a.calculate_threshold(1, 0, None, False, 0.9)
        assert b.last_threshold == 1.0 and a.last_threshold != 1.0


class TestAverage:
    def test_mean_of_thresholds(self) -> None:
        """DL4J's reducer case: workers at 1e-4 and 5e-4 resume at 3e-4."""
        a, b = AdaptiveThreshold(1e-4), AdaptiveThreshold(1e-4)
        a.calculate_threshold(0, 0, None, None, None)
        b.calculate_threshold(0, 0, None, None, None)
        b.last_threshold = 5e-4
        avg = ThresholdAlgorithm.average([a, b])
        assert avg.last_threshold == pytest.approx(3e-4, rel=1e-12)
        assert avg.calculate_threshold(1, 1, None, False, 1e-3) == pytest.approx(3e-4, rel=1e-12)
        assert a.last_threshold == 1e-4  # inputs untouched

    def test_different_settings_average_with_first_settings(self) -> None:
        """DL4J's ThresholdAlgorithmTests: AdaptiveThresholds started at 1e-4 and 5e-4 reduce
        to one at 3e-4, built with the first one's settings (they used to be refused)."""
        a, b = AdaptiveThreshold(1e-4), AdaptiveThreshold(5e-4, 1e-3, 2e-2, 0.9)
        a.calculate_threshold(0, 0, None, None, None)
        b.calculate_threshold(0, 0, None, None, None)
        a.last_density, b.last_density = 1e-3, 3e-3
        avg = ThresholdAlgorithm.average([a, b])
        assert type(avg) is AdaptiveThreshold and avg.settings() == a.settings()
        assert avg.last_threshold == pytest.approx(3e-4, rel=1e-12)
        assert avg.last_density == pytest.approx(2e-3, rel=1e-12)
        f = ThresholdAlgorithm.average([FixedThreshold(1.0), FixedThreshold(2.0)])
        assert f.settings() == {"threshold": 1.0}

    def test_errors(self) -> None:
        with pytest.raises(ValueError, match="none"):
            ThresholdAlgorithm.average([])
        with pytest.raises(TypeError, match="AdaptiveThreshold and FixedThreshold"):
            ThresholdAlgorithm.average([AdaptiveThreshold(), FixedThreshold(1.0)])


class TestOneDefault:
    """`threshold=None` means one thing in every component: the documented default algorithm;
    the dense oracle has its own name, `dense=True`."""

    def test_none_is_the_default_algorithm_everywhere(self) -> None:
        from torch import nn
        from torch.nn import functional as F

        from gradshare import (
            EncodedGradientsAccumulator,
            Encoder,
            ParallelWrapper,
            ThresholdHookState,
        )
        from gradshare.encoding.threshold import DEFAULT_INITIAL, default_threshold

        wrapper = ParallelWrapper(
            nn.Linear(2, 2), lambda p: torch.optim.SGD(p, lr=0.1), F.cross_entropy, num_workers=1
        )
        accumulator = EncodedGradientsAccumulator(2)
        assert accumulator.encoders is not None and wrapper.accumulator.encoders is not None
        algorithms = [
            Encoder().algorithm,
            accumulator.encoders[0].algorithm,
            wrapper.accumulator.encoders[0].algorithm,
            ThresholdHookState().threshold,
        ]
        for algorithm in algorithms:
            assert type(algorithm) is AdaptiveThreshold
            assert algorithm.settings() == default_threshold().settings()
            assert algorithm.initial == DEFAULT_INITIAL

    def test_dense_is_explicit(self) -> None:
        from gradshare import EncodedGradientsAccumulator

        assert EncodedGradientsAccumulator(2, dense=True).encoders is None
        with pytest.raises(ValueError, match="dense=True"):
            EncodedGradientsAccumulator(2, threshold=FixedThreshold(1.0), dense=True)
        with pytest.raises(TypeError, match="FixedThreshold"):
            EncodedGradientsAccumulator(2, threshold=1e-3)  # type: ignore[arg-type]
