"""The encoder (docs/design.md §4): format choice, conservation, stats, non-finite input,
checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradshare import (
    AdaptiveThreshold,
    Encoder,
    FixedThreshold,
    QuantileThreshold,
    ResidualClipping,
    TargetDensityThreshold,
    codec,
    decode_,
    message_info,
    optimal_buffer_size,
)
from gradshare.codec import BITMAP_ENCODING, FLEXIBLE_ENCODING
from gradshare.encoding.encoder import sample_span
from gradshare.encoding.threshold import _kth_largest


class TestConservation:
    """Σ updates = Σ decoded messages + residual + clipped mass, at every step."""

    @settings(max_examples=40, deadline=None)
    @given(
        n=st.integers(1, 2000),
        steps=st.integers(1, 40),
        seed=st.integers(0, 2**31 - 1),
        kind=st.sampled_from(["adaptive", "target", "fixed", "fixed-big"]),
        clip=st.booleans(),
        boundary=st.none() | st.integers(1, 60),
    )
    def test_long_random_streams(
        self, n: int, steps: int, seed: int, kind: str, clip: bool, boundary: int | None
    ) -> None:
        algorithm = {
            "adaptive": lambda: AdaptiveThreshold(1e-3),
            "target": lambda: TargetDensityThreshold(1e-3, 1e-2),
            "fixed": lambda: FixedThreshold(1e-3),
            "fixed-big": lambda: FixedThreshold(5e-2),  # mostly no message at all
        }[kind]()
        enc = Encoder(algorithm, ResidualClipping(2, 3) if clip else None, boundary)
        g = torch.Generator().manual_seed(seed)
        total_in = torch.zeros(n, dtype=torch.float64)
        total_out = torch.zeros(n, dtype=torch.float64)
        last_gap = torch.zeros(n, dtype=torch.float64)
        formats = set()
        for i in range(steps):
            u = torch.randn(n, generator=g) * 1e-3
            total_in += u.double()
            msg = enc.encode(u, i)
            stats = enc.last_stats
            assert stats is not None
            formats.add(stats.format)
            if msg is not None:
                info = message_info(msg)
                assert info.num_entries == stats.entries
                assert stats.message_bytes == msg.numel() * 4
                if boundary is not None and info.format == FLEXIBLE_ENCODING:
                    assert info.num_entries <= boundary
                total_out += decode_(msg, torch.zeros(n)).double()
            assert enc.residual is not None
            gap = total_in - total_out - enc.residual.double()  # what clipping removed
            step_removed = float((gap - last_gap).abs().sum())
            assert step_removed == pytest.approx(stats.clipped, rel=1e-4, abs=1e-6)
            if not clip:
                torch.testing.assert_close(gap, torch.zeros_like(gap), rtol=0, atol=1e-5)
            last_gap = gap
            assert stats.residual_norm == pytest.approx(
                float(enc.residual.double().norm()), rel=1e-4, abs=1e-7
            )


class TestFormatChoice:
    def test_sparse_when_few_cross(self) -> None:
        enc = Encoder(FixedThreshold(1.0))
        u = torch.zeros(1600)
        u[[3, 700]] = torch.tensor([2.5, -1.0])
        msg = enc.encode(u, 0)
        assert msg is not None and msg.tolist() == [2, 1600, 1065353216, 0, 4, -701]
        assert enc.last_stats is not None and enc.last_stats.format == "sparse"

    def test_bitmap_at_dl4j_cutoff_and_nothing_lost(self) -> None:
        """K + 4 >= N//16 -> bitmap, decided before encoding: the bitmap carries every entry
        (DL4J encodes sparse first and loses up to N/16·t here)."""
        n = 1600  # N//16 = 100: 96 entries -> bitmap, 95 -> sparse
        for k, fmt in [(95, FLEXIBLE_ENCODING), (96, BITMAP_ENCODING)]:
            enc = Encoder(FixedThreshold(1.0))
            u = torch.zeros(n)
            u[:k] = 1.0
            msg = enc.encode(u, 0)
            assert msg is not None and message_info(msg).format == fmt
            assert decode_(msg, torch.zeros(n)).sum().item() == k
            assert enc.residual is not None and enc.residual.abs().sum().item() == 0

    def test_nothing_sent_below_two(self) -> None:
        enc = Encoder(FixedThreshold(1.0))
        u = torch.zeros(100)
        u[5] = 3.0
        assert enc.encode(u, 0) is None
        assert enc.last_stats is not None and enc.last_stats.format is None
        assert enc.residual is not None and enc.residual[5].item() == 3.0

    def test_nothing_sent_below_two_for_small_n(self) -> None:
        """Under N = 80 the cut-off K + 4 >= N//16 holds even for K = 0: an empty bitmap used
        to go out, touching the residual (the -t/2 rule) and reported as dense."""
        enc = Encoder(FixedThreshold(1.0))
        u = torch.zeros(32)
        u[3], u[7] = 5.0, -0.6
        assert enc.encode(u, 0) is None
        assert enc.last_stats is not None and enc.last_stats.format is None
        assert enc.last_stats.entries == 0 and enc.last_stats.message_bytes == 0
        assert enc.residual is not None and torch.equal(enc.residual, u)

    def test_zero_updates_lower_the_threshold_for_small_n(self) -> None:
        """Nothing crosses, so the algorithm hears density 0 and t falls (it used to hear
        'dense' and climb: 1e-3 -> 7.7e-3 in 60 steps at N = 32)."""
        for n in (1, 15, 32, 79, 1600):
            enc = Encoder(AdaptiveThreshold(1e-3))
            thresholds = []
            for i in range(60):
                assert enc.encode(torch.zeros(n), i) is None
                assert enc.last_stats is not None
                thresholds.append(enc.last_stats.threshold)
            assert thresholds == sorted(thresholds, reverse=True) and thresholds[-1] < 2e-4

    def test_two_crossing_in_a_small_vector_is_the_spec_bitmap(self) -> None:
        """docs/design.md §1's bitmap vector, through the encoder: 2 cross (and one -t/2), N = 6."""
        enc = Encoder(FixedThreshold(1e-3))
        msg = enc.encode(torch.tensor([0.0, -6e-4, 1e-3, -1e-3, 0.0, 0.0]), 0)
        assert msg is not None and msg.tolist() == [6, 6, 981668463, 1, 655372]
        assert enc.last_stats is not None and enc.last_stats.format == "bitmap"

    def test_threshold_feedback_after_bitmap(self) -> None:
        """After a bitmap the adaptive algorithm is told 'dense' and raises t."""
        enc = Encoder(AdaptiveThreshold(1e-3))
        enc.encode(torch.full((64,), 1.0), 0)
        enc.encode(torch.zeros(64), 1)
        assert enc.last_stats is not None
        assert enc.last_stats.threshold == float(np.float32(1e-3 / AdaptiveThreshold().decay))


class TestInput:
    def test_nonfinite_names_count_and_first_and_leaves_residual(self) -> None:
        enc = Encoder(FixedThreshold(1.0))
        enc.encode(torch.full((10,), 0.5), 0)
        assert enc.residual is not None
        before = enc.residual.clone()
        bad = torch.zeros(10)
        bad[7], bad[3] = float("nan"), float("inf")
        with pytest.raises(ValueError, match=r"2 non-finite value\(s\), the first at flat index 3"):
            enc.encode(bad, 1)
        assert torch.equal(enc.residual, before)

    def test_float64_overflowing_float32_is_nonfinite(self) -> None:
        enc = Encoder(FixedThreshold(1.0))
        with pytest.raises(ValueError, match="non-finite"):
            enc.encode(torch.tensor([1e300, 0.0], dtype=torch.float64), 0)

    def test_wrong_size(self) -> None:
        enc = Encoder()
        enc.encode(torch.zeros(4), 0)
        with pytest.raises(ValueError, match="4 elements"):
            enc.encode(torch.zeros(5), 1)

    @pytest.mark.parametrize("shape", [(0,), (3, 0)])
    def test_empty_update_is_refused_and_changes_nothing(self, shape: tuple[int, ...]) -> None:
        """An update with no elements was a ZeroDivisionError (density = entries / 0)."""
        enc = Encoder(FixedThreshold(0.5))
        with pytest.raises(ValueError, match="`update` to have at least 1 element"):
            enc.encode(torch.zeros(shape), 0)
        assert enc.residual is None and enc.last_stats is None
        enc.encode(torch.full((4,), 0.25), 0)
        with pytest.raises(ValueError, match="at least 1 element"):
            enc.encode(torch.zeros(shape), 1)
        assert enc.residual is not None and enc.residual.tolist() == [0.25] * 4

    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
    def test_any_dtype_and_shape_gives_float32_residual(self, dtype: torch.dtype) -> None:
        enc = Encoder(FixedThreshold(0.5))
        u = torch.zeros(8, 16, dtype=dtype)
        u[0, :3] = torch.tensor([1.5, 2.5, -3.5])
        msg = enc.encode(u, 0)
        assert msg is not None and msg[4:].tolist() == [1, 2, -3]
        assert enc.residual is not None and enc.residual.dtype == torch.float32
        assert enc.residual[:4].tolist() == [1.0, 2.0, -3.0, 0.0]

    @pytest.mark.parametrize("n", [300, 200_000])
    def test_update_already_in_the_residual(self, n: int) -> None:
        """``encode(None, ...)`` encodes the residual as it is (its caller added the update,
        as LocalSteps does with ``decay_add_``): the same message, residual and stats as
        passing that update, sampled threshold included; and refused before any residual."""
        g = torch.Generator().manual_seed(n)
        given, added = Encoder(QuantileThreshold(0.02)), Encoder(QuantileThreshold(0.02))
        for step in range(3):
            u = torch.randn(n, generator=g)
            expected = given.encode(u, step)
            if added.residual is None:
                added.residual = torch.zeros(n)
            added.residual.add_(u)
            got = added.encode(None, step)
            assert expected is not None and got is not None and torch.equal(got, expected)
            assert torch.equal(added.residual, given.residual)
            assert added.last_stats == given.last_stats
        with pytest.raises(ValueError, match="`update=None` encodes the residual as it is"):
            Encoder().encode(None, 0)

    @pytest.mark.parametrize("n", [300, 200_000])
    def test_magnitudes_sampled_by_the_caller(self, n: int) -> None:
        """``encode(None, ..., magnitudes=...)`` with ``|residual|`` at :func:`sample_span`
        (LocalSteps samples them in its Δ pass, ``decay_add_(sample=...)``) is ``encode(None,
        ...)``: the same threshold, message and residual; with an update they are refused."""
        g = torch.Generator().manual_seed(n)
        own, told = Encoder(QuantileThreshold(0.02)), Encoder(QuantileThreshold(0.02))
        for step in range(3):
            u = torch.randn(n, generator=g)
            for enc in (own, told):
                enc.residual = u.clone() if enc.residual is None else enc.residual.add_(u)
            start, stride = sample_span(n, told.algorithm.samples, step)
            assert told.residual is not None
            magnitudes = told.residual[start::stride].abs()
            expected, got = own.encode(None, step), told.encode(None, step, magnitudes=magnitudes)
            assert expected is not None and got is not None and torch.equal(got, expected)
            assert torch.equal(told.residual, own.residual)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="`magnitudes` only with `update=None`"):
            told.encode(torch.ones(n), 3, magnitudes=torch.ones(2))

    def test_bad_threshold_type(self) -> None:
        with pytest.raises(TypeError, match="FixedThreshold"):
            Encoder(1e-3)  # type: ignore[arg-type]


class TestState:
    def test_restore_continues_bit_for_bit(self) -> None:
        g = torch.Generator().manual_seed(0)
        updates = [torch.randn(3000, generator=g) * 1e-3 for _ in range(12)]
        a = Encoder(AdaptiveThreshold(1e-3), ResidualClipping())
        for i, u in enumerate(updates[:6]):
            a.encode(u, i)
        state = a.state_dict()
        b = Encoder(AdaptiveThreshold(1e-3), ResidualClipping())
        b.load_state_dict(state)
        for i, u in enumerate(updates[6:], start=6):
            ma, mb = a.encode(u, i), b.encode(u, i)
            assert (ma is None and mb is None) or (
                ma is not None and mb is not None and torch.equal(ma, mb)
            )
        assert a.residual is not None and b.residual is not None
        assert torch.equal(a.residual, b.residual)

    def test_load_mismatch_changes_nothing(self) -> None:
        a = Encoder(FixedThreshold(1.0))
        a.encode(torch.full((8,), 0.5), 0)
        other = Encoder(FixedThreshold(1.0))
        other.encode(torch.zeros(9), 0)
        before = a.state_dict()
        with pytest.raises(ValueError, match="9 elements"):
            a.load_state_dict(other.state_dict())
        with pytest.raises(ValueError, match="settings"):
            a.load_state_dict(Encoder(FixedThreshold(2.0)).state_dict())
        assert a.residual is not None and torch.equal(a.residual, before["residual"])
        assert a.algorithm.state_dict() == before["algorithm"]


def test_optimal_buffer_size() -> None:
    assert optimal_buffer_size(1_000_000, 4, 2) == ((1_000_000 // 16) + 65536) * 4 * 2 * 4
    with pytest.raises(ValueError, match="num_workers"):
        optimal_buffer_size(10, 0, 1)


def test_import_starts_nothing() -> None:
    """Importing gradshare compiles no kernel, starts no CUDA and no process group."""
    import subprocess
    import sys

    code = (
        "import sys, gradshare, torch\n"
        "assert 'gradshare.codec._kernels' not in sys.modules, 'kernels imported'\n"
        "assert 'numba' not in sys.modules, 'numba imported'\n"
        "assert not torch.cuda.is_initialized()\n"
        "assert not torch.distributed.is_initialized()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


class TestQuantileThreshold:
    """t from a sample of |residual + update|: about `density` of the elements go out from the
    first step, at any scale, and the messages are ordinary DL4J messages."""

    @pytest.mark.parametrize("n", [1, 7, 16_384])
    def test_kth_largest_is_topks_least(self, n: int) -> None:
        """numpy's partition on the CPU picks t as ``torch.topk`` did, ties and NaN (the
        largest, so it makes t NaN once among the k largest) included."""
        g = torch.Generator().manual_seed(n)
        m = torch.randn(n, generator=g).abs().round(decimals=1)
        for case in ("plain", "nan"):
            if case == "nan":
                m[n // 2] = float("nan")
            for k in {1, max(1, n // 25), n}:
                want, got = float(torch.topk(m, k, sorted=False).values.min()), _kth_largest(m, k)
                assert got == want or (np.isnan(got) and np.isnan(want))

    @pytest.mark.parametrize("scale", [1e-6, 1.0, 1e4])
    def test_density_from_the_first_step(self, scale: float) -> None:
        g = torch.Generator().manual_seed(0)
        enc = Encoder(QuantileThreshold(density=0.01))
        for step in range(5):
            update = torch.randn(200_000, generator=g) * scale
            message = enc.encode(update, step)
            assert message is not None and enc.last_stats is not None
            assert enc.last_stats.format == "sparse"
            assert 0.007 < enc.last_stats.density < 0.013, enc.last_stats

    def test_conservation_and_decodable(self) -> None:
        g = torch.Generator().manual_seed(1)
        enc = Encoder(QuantileThreshold(density=0.02, sample=500))
        total, decoded = torch.zeros(5000, dtype=torch.float64), torch.zeros(5000)
        for step in range(20):
            update = torch.randn(5000, generator=g)
            total += update.double()
            message = enc.encode(update, step)
            if message is not None:
                decode_(message, decoded)
        assert enc.residual is not None
        gap = (total - decoded.double() - enc.residual.double()).abs().max()
        assert float(gap) < 1e-4

    def test_zero_updates_send_nothing(self) -> None:
        enc = Encoder(QuantileThreshold())
        for step in range(3):
            assert enc.encode(torch.zeros(1000), step) is None

    def test_resume_continues_bit_for_bit(self) -> None:
        g = torch.Generator().manual_seed(2)
        updates = [torch.randn(30_000, generator=g) for _ in range(6)]
        whole = Encoder(QuantileThreshold(0.005))
        first = Encoder(QuantileThreshold(0.005))
        for i, u in enumerate(updates[:3]):
            whole.encode(u, i), first.encode(u, i)
        resumed = Encoder(QuantileThreshold(0.005))
        resumed.load_state_dict(first.state_dict())
        for i, u in enumerate(updates[3:], start=3):
            a, b = whole.encode(u, i), resumed.encode(u, i)
            assert a is not None and b is not None and torch.equal(a, b)

    def test_warmup_sends_a_falling_density(self) -> None:
        """DGC's warm-up: the density falls geometrically from 25% to `density` over `warmup`
        iterations (bitmaps first), then holds."""
        algorithm = QuantileThreshold(density=0.01, warmup=4)
        assert [round(algorithm.density_at(i), 6) for i in range(6)] == [
            0.25,
            0.111803,
            0.05,
            0.022361,
            0.01,
            0.01,
        ]
        g = torch.Generator().manual_seed(3)
        enc = Encoder(algorithm)
        densities = []
        for step in range(6):
            enc.encode(torch.randn(200_000, generator=g), step)
            assert enc.last_stats is not None
            densities.append(enc.last_stats.density)
        assert densities[0] > 0.2 and 0.04 < densities[2] < 0.06
        assert all(0.007 < d < 0.013 for d in densities[4:])
        assert densities == sorted(densities, reverse=True)
        with pytest.raises(ValueError, match="warmup"):
            QuantileThreshold(warmup=-1)

    def test_settings_checked(self) -> None:
        for bad in (0, 1 / 16, 0.5, -0.1):
            with pytest.raises(ValueError, match="density"):
                QuantileThreshold(density=bad)
        with pytest.raises(ValueError, match="sample"):
            QuantileThreshold(sample=10)


class TestMeanMagnitude:
    """``Encoder(magnitude="mean")``: each message's header float is m, the float32 mean of
    ``|residual + update|`` over the sent elements; exactly ``sign * m`` leaves the residual
    per sent element and decoding gives exactly ``±m``, so the books are exact at every step."""

    @settings(max_examples=30, deadline=None)
    @given(
        n=st.integers(2, 3000),
        steps=st.integers(1, 25),
        seed=st.integers(0, 2**31 - 1),
        kind=st.sampled_from(["adaptive", "fixed", "dense"]),
        boundary=st.none() | st.integers(1, 60),
    )
    def test_exact_books_every_step(
        self, n: int, steps: int, seed: int, kind: str, boundary: int | None
    ) -> None:
        algorithm = {
            "adaptive": lambda: AdaptiveThreshold(1e-3),
            "fixed": lambda: FixedThreshold(1e-3),
            "dense": lambda: FixedThreshold(1e-5),  # most elements cross: bitmaps
        }[kind]()
        enc = Encoder(algorithm, boundary=boundary, magnitude="mean")
        g = torch.Generator().manual_seed(seed)
        residual = torch.zeros(n)
        for i in range(steps):
            u = torch.randn(n, generator=g) * 1e-3
            x = residual + u  # what the encoder sees this step, in float32
            msg = enc.encode(u, i)
            stats = enc.last_stats
            assert stats is not None and enc.residual is not None
            if msg is None:
                assert torch.equal(enc.residual, x) and stats.value == stats.threshold
                residual = x
                continue
            info = message_info(msg)
            m, t = info.threshold, stats.threshold
            assert stats.value == m >= t
            sent = decode_(msg, torch.zeros(n))
            mask = sent != 0
            if info.format == FLEXIBLE_ENCODING:  # the first `boundary` crossing ones
                first = torch.nonzero(x.abs() >= t).view(-1)[: stats.entries]
                assert torch.equal(torch.nonzero(mask).view(-1), first)
            else:  # every crossing one, and no half steps
                assert torch.equal(mask, x.abs() >= t)
            assert int(mask.sum()) == stats.entries
            mags = x[mask].double().abs()
            assert m == float(np.float32(mags.sum().item() / mags.numel()))
            step = torch.sign(x[mask]) * m
            assert torch.equal(sent[mask], step)
            assert torch.equal(enc.residual[mask], x[mask] - step)
            assert torch.equal(enc.residual[~mask], x[~mask])
            residual = enc.residual.clone()
            assert stats.residual_norm == pytest.approx(
                float(residual.double().norm()), rel=1e-4, abs=1e-7
            )

    def test_threshold_mode_sends_t(self) -> None:
        enc = Encoder(FixedThreshold(0.5))
        msg = enc.encode(torch.cat([torch.tensor([1.5, 2.5, -3.5]), torch.zeros(200)]), 0)
        assert msg is not None and msg.tolist() == [3, 203, 1056964608, 0, 1, 2, -3]
        assert enc.last_stats is not None and enc.last_stats.value == enc.last_stats.threshold

    @pytest.mark.parametrize("n", [200, 4])  # sparse, bitmap
    def test_mean_mode_sends_the_mean(self, n: int) -> None:
        enc = Encoder(FixedThreshold(0.5), magnitude="mean")
        x = torch.zeros(n)
        x[:4] = torch.tensor([1.5, 2.5, -3.5, 0.25])
        msg = enc.encode(x, iteration=0)
        assert msg is not None and message_info(msg).threshold == 2.5
        assert enc.residual is not None
        assert enc.residual[:4].tolist() == [-1.0, 0.0, -1.0, 0.25]
        assert enc.last_stats is not None
        assert (enc.last_stats.threshold, enc.last_stats.value) == (0.5, 2.5)
        assert enc.last_stats.entries == 3
        # the algorithm is told t and the density, as with "threshold"
        assert enc._last == ((0.5, False, 3 / n) if n == 200 else (0.5, True, None))

    @pytest.mark.parametrize("value", ["avg", "", None, True])
    def test_bad_setting(self, value: object) -> None:
        with pytest.raises(ValueError, match="`magnitude`"):
            Encoder(FixedThreshold(1.0), magnitude=value)  # type: ignore[arg-type]

    def test_state_keeps_the_setting(self) -> None:
        g = torch.Generator().manual_seed(1)
        updates = [torch.randn(3000, generator=g) * 1e-3 for _ in range(8)]
        a = Encoder(AdaptiveThreshold(1e-3), magnitude="mean")
        for i, u in enumerate(updates[:4]):
            a.encode(u, i)
        state = a.state_dict()
        plain = Encoder(AdaptiveThreshold(1e-3))
        with pytest.raises(ValueError, match="magnitude='mean'"):
            plain.load_state_dict(state)
        assert plain.residual is None
        old = {k: v for k, v in plain.state_dict().items() if k != "magnitude"}
        with pytest.raises(ValueError, match="magnitude='threshold'"):
            Encoder(magnitude="mean").load_state_dict(old)  # saved before the setting existed
        b = Encoder(AdaptiveThreshold(1e-3), magnitude="mean")
        b.load_state_dict(state)
        for i, u in enumerate(updates[4:], start=4):
            ma, mb = a.encode(u, i), b.encode(u, i)
            assert (ma is None and mb is None) or (
                ma is not None and mb is not None and torch.equal(ma, mb)
            )
        assert a.residual is not None and b.residual is not None
        assert torch.equal(a.residual, b.residual)


def test_encode_whole_sends_the_residual_and_the_update_exactly() -> None:
    """A vector too small for threshold messages (a scalar never has 2 entries to cross)
    is sent whole: what left the residual is what the dense piece decodes to, bit for bit;
    the threshold algorithm is not asked."""
    from gradshare.encoding.threshold import QuantileThreshold, sends_whole

    enc = Encoder(QuantileThreshold(0.04))
    assert enc.encode(torch.tensor([0.25]), iteration=0) is None  # DL4J's rule: none, ever
    message = enc.encode_whole(torch.tensor([0.5]), iteration=1)
    assert codec.decode_(message, torch.zeros(1)).item() == 0.75
    assert enc.residual is not None and enc.residual.tolist() == [0.0]
    stats = enc.last_stats
    assert stats is not None and (stats.format, stats.entries, stats.threshold) == ("dense", 1, 0)
    assert enc.algorithm.state_dict()["last_threshold"] is not None  # from encode(), kept
    assert [sends_whole(QuantileThreshold(0.04), n) for n in (1, 2, 37)] == [True, False, False]
    assert [sends_whole(FixedThreshold(1.0), n) for n in (15, 16)] == [True, False]
