"""The fused numba kernels (:mod:`gradshare.codec._kernels`): equal to the torch path bit for bit in
every way a step can end, their constants, serial twins, disk cache, and a CPU without AVX-512.

The wire format and the public API, on both paths, are in tests/test_codec.py.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradshare import codec
from gradshare.codec import (
    MessageError,
    _dispatch,
    _format,
    decode_,
    encode_bitmap_,
    encode_sparse_,
    message_info,
)

from world import selected


def torch_path() -> contextlib.AbstractContextManager[None]:
    """Route every codec call through the vectorised torch ops (the CUDA path), even on CPU."""
    return codec.use_kernels(False)


@pytest.fixture(autouse=True)
def _kernels_on() -> Iterator[None]:
    """The kernels, even where the suite runs with ``GRADSHARE_KERNELS=0``."""
    with codec.use_kernels(True):
        yield


def bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns, so that -0.0 != 0.0 and NaN == NaN."""
    return x.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


class TestKernelsEqualTorch:
    """The fused numba kernels equal the vectorised torch path bit for bit."""

    @pytest.mark.parametrize("n", [1, 15, 16, 17, 255, 257, 4099, 65536 + 17, 300_001])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
    def test_all_four_kernels(self, n: int, dtype: torch.dtype) -> None:
        g = torch.Generator().manual_seed(n)
        x = (torch.randn(n, generator=g) * 1e-3).to(dtype)
        for encode in (
            lambda r: encode_sparse_(r, 1e-3),
            lambda r: encode_sparse_(r, 1e-3, boundary=max(2, n // 50)),
            lambda r: encode_bitmap_(r, 1e-3),
        ):
            a, b = x.clone(), x.clone()
            ma = encode(a)
            with torch_path():
                mb = encode(b)
            assert (ma is None) == (mb is None)
            assert torch.equal(bits(a), bits(b))
            if ma is None or mb is None:
                continue
            assert torch.equal(ma, mb)
            ta = torch.randn(n, generator=g).to(dtype)
            tb = ta.clone()
            decode_(ma, ta)
            with torch_path():
                decode_(mb, tb)
            assert torch.equal(bits(ta), bits(tb))

    def test_overflowing_chunk_candidates(self) -> None:
        """A chunk with more qualifying elements than it remembers is rescanned correctly."""
        n = 3 * 65536
        x = torch.zeros(n)
        x[65536 : 2 * 65536 : 3] = 2.0  # ~21k hits in chunk 1, over its 4096 candidates
        x[5] = -3.0
        a, b = x.clone(), x.clone()
        ma = encode_sparse_(a, 1.0, boundary=15000)
        with torch_path():
            mb = encode_sparse_(b, 1.0, boundary=15000)
        assert ma is not None and mb is not None
        assert torch.equal(ma, mb) and torch.equal(a, b)


CHUNK, CAP, SUPER = 1 << 16, (1 << 16) // 16, 256
"""The kernels' chunk, per-chunk record cap and superblock (checked against _kernels below)."""


def _encoded_alike(x: torch.Tensor, magnitude: str) -> list[torch.Tensor]:
    """Encode copies of ``x`` sparse (one chunk, then a boundary), then as a bitmap, through
    the kernels and the torch path; assert the messages and residuals agree bit for bit and
    return the kernels' messages."""
    messages = []
    for encode in (
        lambda r: encode_sparse_(r, 1.0, magnitude=magnitude),
        lambda r: encode_sparse_(r, 1.0, boundary=777, magnitude=magnitude),
        lambda r: encode_bitmap_(r, 1.0, magnitude=magnitude),
    ):
        a, b = x.clone(), x.clone()
        ma = encode(a)
        with torch_path():
            mb = encode(b)
        assert ma is not None and mb is not None and torch.equal(ma, mb)
        assert torch.equal(bits(a), bits(b))
        messages.append(ma)
    return messages


def _both_paths(
    x: torch.Tensor, steps: Callable[[codec.Workspace, torch.Tensor], object]
) -> tuple[
    tuple[torch.Tensor, object, codec.Workspace], tuple[torch.Tensor, object, codec.Workspace]
]:
    """Run ``steps`` on a copy of ``x`` with the fused kernels and with the torch path."""
    out = []
    for fused in (True, False):
        r = x.clone()
        ws = codec.Workspace()
        with contextlib.nullcontext() if fused else torch_path():
            res = steps(ws, r)
        out.append((r, res, ws))
    return out[0], out[1]


def _same_results(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        assert torch.equal(a, b)
    elif isinstance(a, (tuple, list)):
        assert isinstance(b, (tuple, list)) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same_results(x, y)
    else:
        assert a == b


def _patterned(n: int, per_chunk: list[int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Noise in (-0.7, 0.7) plus, in chunk c, ``per_chunk[c]`` random elements at ±[1.5, 4.5)
    (so that with t = 1 and a small update exactly those qualify)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g, dtype=torch.float64) * 0.3).clamp(-0.7, 0.7)
    for c, hits in enumerate(per_chunk):
        lo, hi = c * CHUNK, min((c + 1) * CHUNK, n)
        if hits and lo < hi:
            pos = lo + torch.randperm(hi - lo, generator=g)[: min(hits, hi - lo)]
            sign = torch.where(torch.rand(pos.numel(), generator=g) < 0.5, 1.0, -1.0)
            mag = 1.5 + torch.rand(pos.numel(), generator=g, dtype=torch.float64) * 3
            x[pos] = sign.double() * mag
    return x.to(dtype)


# chunks: sparse, dense (branch-free), exactly CAP, CAP + 1 (overflow), far over, empty
PATTERNS = (
    (3, 0, 1),
    (2000, 40, 0, 4000),
    (CAP, CAP + 1, 5, CAP - 1),
    (CAP + 300, 10, 9000, 0, 2),
    (0, 0, 0, 2),
)


class TestSpeculativeScan:
    """The fused scan moves qualifying elements ahead and records their old values; every way
    the step can end (emit all, a boundary, a bitmap instead, nothing sent, abandoned) must
    leave exactly what the torch path leaves, bit for bit."""

    def test_constants_match_kernels(self) -> None:
        k = _dispatch.kernels()
        assert (k.CHUNK, k.CAP, k.SUPER) == (CHUNK, CAP, SUPER)
        assert _dispatch.SMALL == k.SMALL
        assert _format.NBINS == k.NBINS

    def test_every_kernel_is_cached_on_disk(self) -> None:
        """Guards the serial twins being recompiled in every process (seconds per kernel)."""
        k = _dispatch.kernels()
        for name, kernel in [*k.PARALLEL.items(), *k.SERIAL.items()]:
            assert type(kernel._cache).__name__ == "FunctionCache", name
        assert k.STRIDE >= k.CAP + k.SUPER + k.W

    @pytest.mark.parametrize("pattern", PATTERNS)
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
    @pytest.mark.parametrize("tail", [0, 100, 16 * 3 + 5])
    def test_emit_with_limits(
        self, pattern: tuple[int, ...], dtype: torch.dtype, tail: int
    ) -> None:
        n = (len(pattern) - 1) * CHUNK + CHUNK // 2 + tail
        x = _patterned(n, list(pattern), dtype, seed=len(pattern) + tail)
        u = (torch.randn(n, generator=torch.Generator().manual_seed(7)) * 0.05).to(dtype)
        total = int(((x + u).abs() >= 1.0).sum())
        limits = {None, 1, 2, 3, total, total + 5, max(1, total // 2), pattern[0] + 1}
        limits |= {max(1, min(total, sum(pattern[:c]))) for c in range(1, len(pattern))}
        for limit in sorted(limits, key=lambda v: -1 if v is None else v):

            def steps(ws: codec.Workspace, r: torch.Tensor, limit: int | None = limit) -> object:
                count = ws.scan_(r, u, 1.0)
                msg = ws.emit_(r, limit) if count >= 2 else None
                return count, msg

            (ra, resa, wsa), (rb, resb, wsb) = _both_paths(x, steps)
            _same_results(resa, resb)
            assert torch.equal(bits(ra), bits(rb))
            assert wsa.sumsq == pytest.approx(wsb.sumsq, rel=1e-5, abs=1e-9)

    @pytest.mark.parametrize("pattern", PATTERNS)
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
    def test_bitmap_after_scan_puts_moves_back(
        self, pattern: list[int], dtype: torch.dtype
    ) -> None:
        """The encoder's bitmap step: scan (which moved ahead), then bitmap the same residual."""
        n = len(pattern) * CHUNK - 37
        x = _patterned(n, list(pattern), dtype, seed=11)
        u = (torch.randn(n, generator=torch.Generator().manual_seed(3)) * 0.05).to(dtype)
        for update_in_bitmap in (False, True):

            def steps(
                ws: codec.Workspace, r: torch.Tensor, both: bool = update_in_bitmap
            ) -> object:
                count = ws.scan_(r, u, 1.0)
                return count, ws.bitmap_(r, 1.0, u if both else None)

            (ra, resa, _), (rb, resb, _) = _both_paths(x, steps)
            _same_results(resa, resb)
            assert torch.equal(bits(ra), bits(rb))

    @pytest.mark.parametrize(("before", "in_tail"), [(CAP - 3, 10), (CAP - 10, 10), (CAP, 1)])
    def test_overflow_in_last_partial_superblock(self, before: int, in_tail: int) -> None:
        """The count of the last chunk crosses CAP (or just reaches it) in its scalar tail."""
        n = 2 * CHUNK - 100
        tail = n - CHUNK - (n - CHUNK) % SUPER + CHUNK
        g = torch.Generator().manual_seed(before)
        x = (torch.randn(n, generator=g) * 0.2).clamp(-0.7, 0.7)
        x[5] = 2.0
        x[CHUNK + torch.randperm(tail - CHUNK, generator=g)[:before]] = -2.5
        x[tail + torch.randperm(n - tail, generator=g)[:in_tail]] = 3.0
        for limit in (None, 2, before, before + in_tail // 2):

            def steps(ws: codec.Workspace, r: torch.Tensor, limit: int | None = limit) -> object:
                ws.scan_(r, None, 1.0)
                return ws.emit_(r, limit)

            (ra, resa, _), (rb, resb, _) = _both_paths(x, steps)
            _same_results(resa, resb)
            assert torch.equal(bits(ra), bits(rb))

    @pytest.mark.parametrize("hits", [0, 1])
    def test_fewer_than_two_leaves_only_the_addition(self, hits: int) -> None:
        n = 3 * CHUNK + 5
        x = _patterned(n, [0, hits, 0, 0], torch.float32, seed=5)
        u = torch.full((n,), 1e-3)
        r = x.clone()
        ws = codec.Workspace()
        assert ws.scan_(r, u, 1.0) == hits
        assert torch.equal(bits(r), bits(x + u))

    def test_settle_and_rescan_undo_exactly(self) -> None:
        n = 2 * CHUNK + 999
        x = _patterned(n, [500, CAP + 7, 50], torch.float32, seed=9)
        u = torch.randn(n, generator=torch.Generator().manual_seed(1)) * 0.1
        r = x.clone()
        ws = codec.Workspace()
        ws.scan_(r, u, 1.0)
        ws.settle_()
        assert torch.equal(bits(r), bits(x + u))
        ws.settle_()  # nothing pending: a no-op
        assert torch.equal(bits(r), bits(x + u))
        # an abandoned scan is undone by the next one; emitting after settle_ re-finds the moves
        ws.scan_(r, None, 1.0)
        ws.scan_(r, None, 0.5)
        ws.settle_()
        assert torch.equal(bits(r), bits(x + u))
        ref = x + u
        with torch_path():
            ws_ref = codec.Workspace()
            ws_ref.scan_(ref, None, 0.5)
            want = ws_ref.emit_(ref, 1234)
        assert torch.equal(ws.emit_(r, 1234), want)
        assert torch.equal(bits(r), bits(ref))

    def test_other_residual_between_scan_and_emit(self) -> None:
        """A workspace told to emit for another tensor first puts the pending moves back."""
        a = _patterned(CHUNK + 10, [300, 3], torch.float32, seed=1)
        b = _patterned(CHUNK + 10, [30, 30], torch.float32, seed=2)
        ra, rb = a.clone(), b.clone()
        ws = codec.Workspace()
        ws.scan_(ra, None, 1.0)
        ws.count = int((b.abs() >= 1.0).sum())
        msg = ws.emit_(rb)
        assert torch.equal(bits(ra), bits(a))
        ref = b.clone()
        want = encode_sparse_(ref, 1.0)
        assert want is not None and torch.equal(msg, want) and torch.equal(bits(rb), bits(ref))

    def test_special_values(self) -> None:
        """NaN, ±inf, -0.0 and subnormals take the same path through kernels and torch."""
        vals = [float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-45, -1e-45, 3.0, -3.0]
        _encoded_alike(torch.tensor(vals * 40000, dtype=torch.float32), "threshold")

    @settings(max_examples=25, deadline=None)
    @given(
        n=st.integers(1, 3 * CHUNK),
        density=st.sampled_from([0.0005, 0.01, 0.03, 0.07, 0.2]),
        limit=st.none() | st.integers(1, 20000),
        seed=st.integers(0, 2**31 - 1),
        bitmap=st.booleans(),
    )
    def test_random_steps_equal_torch(
        self, n: int, density: float, limit: int | None, seed: int, bitmap: bool
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, generator=g) * 0.3
        u = torch.randn(n, generator=g) * 0.3
        t = codec.float32_threshold(float(torch.quantile((x + u).abs().double(), 1 - density)))

        def steps(ws: codec.Workspace, r: torch.Tensor) -> object:
            count = ws.scan_(r, u, t)
            if bitmap:
                return count, ws.bitmap_(r, t)
            return count, ws.emit_(r, limit) if count >= 2 else None

        (ra, resa, wsa), (rb, resb, wsb) = _both_paths(x, steps)
        _same_results(resa, resb)
        assert torch.equal(bits(ra), bits(rb))
        assert wsa.sumsq == pytest.approx(wsb.sumsq, rel=1e-4, abs=1e-9)


AVX2_ONLY = (
    "import torch\n"
    "from gradshare import codec\n"
    "from gradshare.codec import encode_sparse_, encode_bitmap_, decode_\n"
    "g = torch.Generator().manual_seed(0)\n"
    "x = torch.randn(3 * 65536 + 77, generator=g) * 1e-3\n"
    "x[65536:65536 + 30000] *= 40\n"
    "for enc in (lambda r: encode_sparse_(r, 1e-3),\n"
    "            lambda r: encode_sparse_(r, 1e-3, 5000),\n"
    "            lambda r: encode_bitmap_(r, 1e-3)):\n"
    "    a, b = x.clone(), x.clone()\n"
    "    ma = enc(a)\n"
    "    with codec.use_kernels(False):\n"
    "        mb = enc(b)\n"
    "    assert torch.equal(ma, mb) and torch.equal(a, b)\n"
    "import gradshare.codec._kernels as k\n"
    "cg = k.scan.targetctx.codegen()\n"
    "assert '+avx512f' not in cg._tm_features, cg._tm_features\n"
    "print('ok')\n"
)
"""Compiles the kernels for a CPU without AVX-512 and compares them with the torch path."""


@pytest.fixture(scope="module", autouse=True)
def without_avx512(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[subprocess.Popen[str] | None]:
    """:data:`AVX2_ONLY` in a fresh process with its own numba cache, started with the module's
    first test: its compilation (tens of seconds, one thread) runs beside the other tests."""
    if not selected(request, "test_kernels_without_avx512"):
        yield None
        return
    env = dict(
        os.environ,
        NUMBA_CPU_NAME="haswell",
        NUMBA_CPU_FEATURES="+64bit,+avx,+avx2,+fma,+bmi,+bmi2,+popcnt,+sse4.2,+f16c,+lzcnt,-avx512f",
        NUMBA_CACHE_DIR=str(tmp_path_factory.mktemp("numba-avx2")),
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", AVX2_ONLY],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    yield proc
    proc.kill()
    proc.communicate()


def test_kernels_without_avx512(without_avx512: subprocess.Popen[str] | None) -> None:
    """Compiled for a CPU without AVX-512 (LLVM then expands the vector compress), the kernels
    still equal the torch path bit for bit. Runs in a fresh process with its own numba cache.
    float32 only: the models' type, and its compress the widest (16 lanes); compiling the
    float64 kernels too doubled the process's 15 s of compilation."""
    assert without_avx512 is not None
    out, err = without_avx512.communicate(timeout=600)
    assert without_avx512.returncode == 0, err[-3000:]
    assert out.strip().endswith("ok")


def test_serial_kernels_equal_parallel() -> None:
    """The serial twins (used by worker threads) give the parallel kernels' results bit for
    bit: sparse with and without a boundary, bitmap, fused sums, validation, finiteness."""
    x = _patterned(3 * 65536 + 77, [5, 5000, 40], torch.float32, seed=4)
    results = []
    for ctx in (contextlib.nullcontext, codec.serial_kernels):
        with ctx():
            out = []
            for encode in (
                lambda r: encode_sparse_(r, 1.0),
                lambda r: encode_sparse_(r, 1.0, 3000),
                lambda r: encode_bitmap_(r, 1.0),
            ):
                r = x.clone()
                out += [encode(r), r]
            total = torch.empty_like(x)
            codec.decode_sum_([out[0], out[4]], total, divisor=3)
            out.append(total)
            bad = out[0].clone()
            bad[-1] = bad[-2]
            with pytest.raises(MessageError, match=f"entry {bad.numel() - 5} is"):
                codec.check_message(bad, x.numel())
            y = x.clone()
            y[[7, 70000]] = float("nan")
            out.append(torch.tensor(codec.find_nonfinite(y)))
            results.append(out)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


class TestMeanMagnitudeKernels:
    """``magnitude="mean"`` on the fused kernels equals the torch path bit for bit."""

    @pytest.mark.parametrize("pattern", PATTERNS)
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
    def test_kernels_equal_torch(self, pattern: tuple[int, ...], dtype: torch.dtype) -> None:
        """Every way a step can end, with the speculative scan's moves in place before it."""
        n = len(pattern) * CHUNK - 37
        x = _patterned(n, list(pattern), dtype, seed=len(pattern))
        u = (torch.randn(n, generator=torch.Generator().manual_seed(7)) * 0.05).to(dtype)
        total = int(((x + u).abs() >= 1.0).sum())
        for end in ["all", 2, max(1, total // 2), "bitmap", "bitmap+update"]:

            def steps(ws: codec.Workspace, r: torch.Tensor, end: object = end) -> object:
                if end == "bitmap+update":
                    ws.scan_(r, u, 1.0)
                    return ws.bitmap_(r, 1.0, u, mean=True), ws.value
                count = ws.scan_(r, u, 1.0)
                if end == "bitmap":
                    return count, ws.bitmap_(r, 1.0, mean=True), ws.value
                if count < 2:
                    return count
                limit = None if end == "all" else int(end)  # type: ignore[call-overload]
                return count, ws.emit_(r, limit, mean=True), ws.value

            (ra, resa, wsa), (rb, resb, wsb) = _both_paths(x, steps)
            _same_results(resa, resb)
            assert torch.equal(bits(ra), bits(rb))
            assert wsa.sumsq == pytest.approx(wsb.sumsq, rel=1e-5, abs=1e-9)
            assert wsa.sumsq == pytest.approx(float(ra.double().square().sum()), rel=1e-5, abs=1e-9)

    def test_special_values(self) -> None:
        """inf counts as the largest float32 (m stays finite); NaN is never sent."""
        vals = [float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-45, -1e-45, 3.0, -3.0]
        for ma in _encoded_alike(torch.tensor(vals * 40000, dtype=torch.float32), "mean"):
            m = message_info(ma).threshold
            assert 3.0 < m < float("inf")
