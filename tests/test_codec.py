"""The wire format (docs/design.md §1): DL4J's vectors, round trips, validation, kernels vs
torch."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradshare import codec
from gradshare.codec import (
    BITMAP_ENCODING,
    FLEXIBLE_ENCODING,
    MessageError,
    decode_,
    encode_bitmap_,
    encode_sparse_,
    message_info,
)

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@contextlib.contextmanager
def torch_path() -> Iterator[None]:
    """Route every codec call through the vectorised torch ops (the CUDA path), even on CPU."""
    saved = codec._use_kernels
    codec._use_kernels = lambda x: False  # type: ignore[assignment]
    try:
        yield
    finally:
        codec._use_kernels = saved  # type: ignore[assignment]


def bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns, so that -0.0 != 0.0 and NaN == NaN."""
    return x.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


class TestDL4JVectors:
    """The exact vectors of DL4J's own tests (docs/design.md §1): messages match word for word."""

    def test_sparse_vector_and_residual(self) -> None:
        r = torch.tensor([1.5, 2.5, -3.5])
        msg = encode_sparse_(r, 0.5)
        assert msg is not None
        assert msg.dtype == torch.int32
        assert msg.tolist() == [3, 3, 1056964608, 0, 1, 2, -3]
        assert r.tolist() == [1.0, 2.0, -3.0]
        decode_(msg, r)
        assert r.tolist() == [1.5, 2.5, -3.5]

    def test_bitmap_vector_word_655372(self) -> None:
        r = torch.tensor([0, -6e-4, 1e-3, -1e-3, 0, 0], dtype=torch.float32)
        msg = encode_bitmap_(r, 1e-3)
        assert msg.tolist() == [6, 6, 981668463, 1, 655372]
        expected = torch.tensor([0, -6e-4, 1e-3, -1e-3, 0, 0]) - torch.tensor(
            [0, -5e-4, 1e-3, -1e-3, 0, 0]
        )
        torch.testing.assert_close(r, expected, rtol=0, atol=1e-9)
        assert r[1].item() == pytest.approx(-1e-4, abs=1e-9)
        out = decode_(msg, torch.zeros(6))
        t = float(np.float32(1e-3))
        assert out.tolist() == [0, -t / 2, t, -t, 0, 0]

    def test_boundary_ten_ones(self) -> None:
        r = torch.ones(10)
        msg = encode_sparse_(r, 1.0, boundary=3)
        assert msg is not None and msg.numel() == 7
        assert r.sum().item() == 7
        assert msg[4:].tolist() == [1, 2, 3]

    def test_boundary_thousand_ones(self) -> None:
        r = torch.ones(1000)
        msg = encode_sparse_(r, 1.0, boundary=100)
        assert msg is not None and msg.numel() == 104
        assert r.sum().item() == 900

    def test_below_threshold_sends_nothing(self) -> None:
        r = torch.tensor([1e-4, -1e-4, 0, 0, 1e-4, -1e-4])
        before = r.clone()
        assert encode_sparse_(r, 1e-3) is None
        assert torch.equal(bits(r), bits(before))

    def test_one_qualifying_element_sends_nothing(self) -> None:
        """DL4J's rule: fewer than 2 qualifying elements -> no message, residual untouched."""
        r = torch.tensor([0.0, 2.0, 0.0])
        assert encode_sparse_(r, 1.0) is None
        assert r.tolist() == [0.0, 2.0, 0.0]

    @pytest.mark.parametrize("n,words", [(15, 5), (31, 6), (32, 7), (16, 6)])
    def test_bitmap_lengths(self, n: int, words: int) -> None:
        assert encode_bitmap_(torch.zeros(n), 0.1).numel() == words
        assert codec.bitmap_length(n) == words

    def test_threshold_rounded_to_float32(self) -> None:
        r = torch.tensor([1e-3, 2e-3, 2e-3], dtype=torch.float64)
        msg = encode_sparse_(r, 1e-3)
        assert msg is not None and msg[2].item() == 981668463
        t = float(np.float32(1e-3))
        assert t > 1e-3 and message_info(msg).threshold == t
        assert msg[4:].tolist() == [2, 3]  # 1e-3 itself is below float32(1e-3)
        assert r.tolist() == [1e-3, 2e-3 - t, 2e-3 - t]

    def test_only_t_moves(self) -> None:
        """Sparse encoding subtracts t, not the value: the remainder stays."""
        r = torch.tensor([3.25, -2.75, 0.5, 1.0])
        msg = encode_sparse_(r, 1.0)
        assert msg is not None and msg[4:].tolist() == [1, -2, 4]
        assert r.tolist() == [2.25, -1.75, 0.5, 0.0]

    def test_bitmap_asymmetry(self) -> None:
        """Positive values in [t/2, t) stay; negative ones in (-t, -t/2] go as -t/2."""
        r = torch.tensor([0.75, -0.75, 0.25, -0.25, 1.0, -1.0, 2.5, -2.5])
        msg = encode_bitmap_(r, 1.0)
        assert r.tolist() == [0.75, -0.25, 0.25, -0.25, 0.0, 0.0, 1.5, -1.5]
        out = decode_(msg, torch.zeros(8))
        assert out.tolist() == [0.0, -0.5, 0.0, 0.0, 1.0, -1.0, 1.0, -1.0]
        assert message_info(msg).num_entries == 5


class TestDecodeAdds:
    def test_decoding_twice_adds_twice(self) -> None:
        r = torch.tensor([1.5, 2.5, -3.5])
        msg = encode_sparse_(r, 0.5)
        assert msg is not None
        target = torch.full((3,), 10.0)
        decode_(msg, target)
        decode_(msg, target)
        assert target.tolist() == [11.0, 11.0, 9.0]

    def test_message_info(self) -> None:
        msg = encode_sparse_(torch.ones(1000), 1.0, boundary=100)
        assert msg is not None
        info = message_info(msg)
        assert (info.format, info.num_entries, info.numel, info.threshold, info.nbytes) == (
            FLEXIBLE_ENCODING,
            100,
            1000,
            1.0,
            416,
        )
        bm = message_info(encode_bitmap_(torch.ones(33), 0.5))
        assert (bm.format, bm.num_entries, bm.numel, bm.nbytes) == (BITMAP_ENCODING, 33, 33, 28)
        assert bm.format_name == "bitmap"


class TestInputChecks:
    """Bad inputs name the problem; nothing is changed."""

    def test_two_dimensional(self) -> None:
        with pytest.raises(ValueError, match="1-D"):
            encode_sparse_(torch.ones(2, 2), 1.0)

    def test_integer_dtype(self) -> None:
        with pytest.raises(TypeError, match="dtype"):
            encode_bitmap_(torch.ones(4, dtype=torch.int32), 1.0)

    def test_non_contiguous(self) -> None:
        with pytest.raises(ValueError, match="contiguous"):
            encode_sparse_(torch.ones(8)[::2], 1.0)

    def test_too_large(self) -> None:
        big = torch.empty(2**31, device="meta")  # shape only, nothing allocated
        with pytest.raises(ValueError, match="2\\*\\*31"):
            encode_sparse_(big, 1.0)

    @pytest.mark.parametrize("t", [0.0, -1.0, float("nan"), float("inf"), 1e-50, 1e39])
    def test_bad_threshold(self, t: float) -> None:
        r = torch.ones(4)
        with pytest.raises(ValueError, match="threshold"):
            encode_sparse_(r, t)
        assert r.tolist() == [1.0] * 4

    def test_bad_boundary(self) -> None:
        with pytest.raises(ValueError, match="boundary"):
            encode_sparse_(torch.ones(4), 1.0, boundary=0)


def _good_sparse(n: int = 40) -> tuple[torch.Tensor, int]:
    r = torch.zeros(n)
    r[::3] = 2.0
    r[1::7] = -2.0
    msg = encode_sparse_(r, 1.0)
    assert msg is not None
    return msg, n


def _good_bitmap(n: int = 40) -> tuple[torch.Tensor, int]:
    r = torch.linspace(-2, 2, n)
    return encode_bitmap_(r, 1.0), n


class TestValidation:
    """A decoder validates the whole message before it writes a single element."""

    @staticmethod
    def _rejects(msg: torch.Tensor, n: int, match: str) -> None:
        target = torch.randn(n)
        before = bits(target).clone()
        with pytest.raises(MessageError, match=match):
            decode_(msg, target)
        assert torch.equal(bits(target), before)

    def test_unknown_format(self) -> None:
        msg, n = _good_sparse()
        msg[3] = 7
        self._rejects(msg, n, "format id 7")

    def test_wrong_numel(self) -> None:
        msg, _ = _good_sparse(40)
        self._rejects(msg, 41, "N = 40")

    def test_length_mismatch(self) -> None:
        msg, n = _good_sparse()
        self._rejects(msg[:-1].clone(), n, "K = ")

    def test_zero_index(self) -> None:
        msg, n = _good_sparse()
        msg[6] = 0
        self._rejects(msg, n, "is 0")

    def test_index_out_of_range(self) -> None:
        msg, n = _good_sparse()
        msg[-1] = n + 1
        self._rejects(msg, n, "outside")

    def test_int32_min_entry(self) -> None:
        msg, n = _good_sparse()
        msg[-1] = -(2**31)
        self._rejects(msg, n, "outside")

    def test_not_ascending_fault_after_valid_prefix(self) -> None:
        """The bad entry is last: a decoder that writes as it validates would have written."""
        msg, n = _good_sparse()
        msg[-1] = msg[-2]
        self._rejects(msg, n, "ascending")

    @pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
    def test_bad_threshold(self, value: float) -> None:
        msg, n = _good_bitmap()
        msg[2] = int(np.float32(value).view(np.int32))
        self._rejects(msg, n, "threshold")

    def test_bitmap_bits_past_n(self) -> None:
        msg, n = _good_bitmap(40)
        msg[-1] = msg[-1] | (1 << 9)  # element 41 of 40
        self._rejects(msg, n, "past N")

    def test_bitmap_header_mismatch(self) -> None:
        msg, n = _good_bitmap()
        msg[0] = 39
        self._rejects(msg, n, "both be N")

    @pytest.mark.parametrize("where", [0, -1])
    def test_large_message_fault_leaves_target(self, where: int) -> None:
        """Messages past the serial-decode size take the parallel validator: same guarantee."""
        n = 200_000
        r = torch.zeros(n)
        r[::4] = 2.0  # 50k entries
        msg = encode_sparse_(r, 1.0)
        assert msg is not None and msg.numel() - 4 > codec._k().SMALL
        msg[4 + where if where >= 0 else where] = 0
        self._rejects(msg, n, "is 0")

    def test_wrong_dtype_and_short(self) -> None:
        msg, n = _good_sparse()
        self._rejects(msg.to(torch.int64), n, "int32")
        self._rejects(msg[:3].clone(), n, "header")


@settings(max_examples=300, deadline=None)
@given(
    data=st.binary(min_size=0, max_size=200),
    n=st.integers(1, 70),
    mutate=st.integers(0, 3),
)
def test_fuzz_decoder_only_message_error(data: bytes, n: int, mutate: int) -> None:
    """Random and mutated messages: decode either succeeds or raises MessageError, and a failed
    decode leaves the target bit-for-bit unchanged."""
    if mutate == 0:
        words = np.frombuffer(data[: len(data) // 4 * 4], dtype=np.int32).copy()
    else:
        n = max(n, 8)
        base = (_good_sparse if mutate == 1 else _good_bitmap)(n)[0].numpy().copy()
        raw = bytearray(base.tobytes())
        for i, b in enumerate(data[:8]):
            raw[(i * 7919 + b) % len(raw)] ^= 1 << (b % 8)
        words = np.frombuffer(bytes(raw), dtype=np.int32).copy()
    msg = torch.from_numpy(words)
    target = torch.randn(n)
    before = bits(target).clone()
    try:
        decode_(msg, target)
    except MessageError:
        assert torch.equal(bits(target), before)


residuals = st.builds(
    lambda n, seed, scale: torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale,
    st.integers(1, 300),
    st.integers(0, 2**31 - 1),
    st.sampled_from([0.1, 1.0, 3.0]),
)


@settings(max_examples=150, deadline=None)
@given(r=residuals, t=st.sampled_from([0.25, 0.5, 1.0]), boundary=st.none() | st.integers(1, 50))
def test_sparse_roundtrip_reconstructs_what_left(
    r: torch.Tensor, t: float, boundary: int | None
) -> None:
    """decode(encode(r)) + residual == r exactly (t is a power of 2), entries ascending,
    boundary honoured."""
    before = r.clone()
    msg = encode_sparse_(r, t, boundary)
    qualifying = int((before.abs() >= t).sum())
    if qualifying < 2:
        assert msg is None and torch.equal(r, before)
        return
    assert msg is not None
    entries = msg[4:].long()
    assert entries.numel() == (qualifying if boundary is None else min(boundary, qualifying))
    assert bool((entries.abs()[1:] > entries.abs()[:-1]).all())
    sent = decode_(msg, torch.zeros_like(r))
    torch.testing.assert_close(sent + r, before, rtol=0, atol=1e-6)


@settings(max_examples=150, deadline=None)
@given(r=residuals, t=st.sampled_from([0.25, 0.5, 1.0]))
def test_bitmap_roundtrip_reconstructs_what_left(r: torch.Tensor, t: float) -> None:
    before = r.clone()
    msg = encode_bitmap_(r, t)
    sent = decode_(msg, torch.zeros_like(r))
    torch.testing.assert_close(sent + r, before, rtol=0, atol=1e-6)
    assert set(sent.unique().tolist()) <= {0.0, t, -t, -t / 2}
    assert torch.equal(sent != 0, (before.abs() >= t) | (before <= -t / 2))


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
        k = codec._k()
        assert (k.CHUNK, k.CAP, k.SUPER) == (CHUNK, CAP, SUPER)
        assert codec._SMALL == k.SMALL

    def test_every_kernel_is_cached_on_disk(self) -> None:
        """Guards the serial twins being recompiled in every process (seconds per kernel)."""
        k = codec._k()
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
        x = torch.tensor(vals * 40000, dtype=torch.float32)
        for encode in (
            lambda r: encode_sparse_(r, 1.0),
            lambda r: encode_sparse_(r, 1.0, boundary=777),
            lambda r: encode_bitmap_(r, 1.0),
        ):
            a, b = x.clone(), x.clone()
            ma = encode(a)
            with torch_path():
                mb = encode(b)
            assert ma is not None and mb is not None and torch.equal(ma, mb)
            assert torch.equal(bits(a), bits(b))

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


def test_kernels_without_avx512(tmp_path: Path) -> None:
    """Compiled for a CPU without AVX-512 (LLVM then expands the vector compress), the kernels
    still equal the torch path bit for bit. Runs in a fresh process with its own numba cache."""
    script = (
        "import torch\n"
        "from gradshare import codec\n"
        "from gradshare.codec import encode_sparse_, encode_bitmap_, decode_\n"
        "for dtype in (torch.float32, torch.float64):\n"
        "    g = torch.Generator().manual_seed(0)\n"
        "    x = (torch.randn(3 * 65536 + 77, generator=g) * 1e-3).to(dtype)\n"
        "    x[65536:65536 + 30000] *= 40\n"
        "    for enc in (lambda r: encode_sparse_(r, 1e-3),\n"
        "                lambda r: encode_sparse_(r, 1e-3, 5000),\n"
        "                lambda r: encode_bitmap_(r, 1e-3)):\n"
        "        a, b = x.clone(), x.clone()\n"
        "        ma = enc(a)\n"
        "        saved, codec._use_kernels = codec._use_kernels, lambda x: False\n"
        "        mb = enc(b)\n"
        "        codec._use_kernels = saved\n"
        "        assert torch.equal(ma, mb) and torch.equal(a, b)\n"
        "import gradshare._kernels as k\n"
        "cg = k.scan.targetctx.codegen()\n"
        "assert '+avx512f' not in cg._tm_features, cg._tm_features\n"
        "print('ok')\n"
    )
    env = dict(
        os.environ,
        NUMBA_CPU_NAME="haswell",
        NUMBA_CPU_FEATURES="+64bit,+avx,+avx2,+fma,+bmi,+bmi2,+popcnt,+sse4.2,+f16c,+lzcnt,-avx512f",
        NUMBA_CACHE_DIR=str(tmp_path),
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")


@pytest.mark.parametrize("dtype", FLOATS)
def test_every_dtype_roundtrip(dtype: torch.dtype) -> None:
    """float16/bfloat16 go through the torch path: values compare in float32, results round."""
    r = torch.tensor([1.5, -2.5, 0.25, 3.0, -0.75], dtype=dtype)
    before = r.clone()
    msg = encode_sparse_(r, 1.0)
    assert msg is not None and msg[4:].tolist() == [1, -2, 4]
    assert r.dtype == dtype
    assert decode_(msg, r).tolist() == before.tolist()
    r = before.clone()
    bm = encode_bitmap_(r, 1.0)
    assert decode_(bm, r).tolist() == before.tolist()


def test_decode_rejects_other_device_message() -> None:
    msg, n = _good_sparse()
    with pytest.raises(ValueError, match="device"):
        decode_(msg.to("meta"), torch.zeros(n))


def _plant(host: torch.Tensor, at: int, message: torch.Tensor) -> torch.Tensor:
    """Copy ``message`` into ``host``'s bytes from element ``at`` on; return that int32 view."""
    start = at * host.element_size()
    view = host.view(torch.uint8)[start : start + 4 * message.numel()].view(torch.int32)
    view.copy_(message)
    return view


def _sparse_of(entries: list[int], n: int, t: float = 0.5) -> torch.Tensor:
    bits32 = int(torch.tensor([t]).view(torch.int32))
    return torch.tensor([len(entries), n, bits32, FLEXIBLE_ENCODING, *entries], dtype=torch.int32)


class TestMessageInTargetMemory:
    """A message that lies in the memory it decodes into is refused before anything is
    written: decoding reads entries that its own writes change, past the checks (the numba
    kernels do not check bounds again, so that was an out-of-bounds write)."""

    @staticmethod
    def _refused(call: Callable[[], object], *buffers: torch.Tensor) -> None:
        before = [bits(b).clone() for b in buffers]
        with pytest.raises(MessageError, match=r"separate memory.*Clone the message first"):
            call()
        for b, old in zip(buffers, before, strict=True):
            assert torch.equal(bits(b), old)

    def test_self_rewriting_message_is_refused(self) -> None:
        """The report's repro: decoding into t[15] turned entry 17 into 1056964608, a write
        far past the end (a segfault)."""
        t = torch.zeros(100)
        m = t[10:20].view(torch.int32)
        m[:] = _sparse_of([16, 17, 18, 19, 20, 21], 100)
        self._refused(lambda: decode_(m, t), t)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
    @pytest.mark.parametrize("entries", [10, codec._SMALL + 10])
    def test_sparse_inside_target(self, dtype: torch.dtype, entries: int) -> None:
        """The small fast path, the large path and the torch path (float16) all refuse."""
        n = 4 * entries + 16
        t = torch.zeros(n, dtype=dtype)
        m = _plant(t, entries + 8, _sparse_of(list(range(1, entries + 1)), n))
        self._refused(lambda: decode_(m, t), t)
        with torch_path():
            self._refused(lambda: decode_(m, t), t)

    def test_bitmap_inside_target(self) -> None:
        t = torch.zeros(64)
        bitmap = torch.tensor([64, 64, 1056964608, BITMAP_ENCODING, 1, 0, 0, 0, 0])
        m = _plant(t, 40, bitmap.to(torch.int32))
        self._refused(lambda: decode_(m, t), t)
        with torch_path():
            self._refused(lambda: decode_(m, t), t)

    def test_one_byte_of_overlap_is_enough(self) -> None:
        host = torch.zeros(64, dtype=torch.float64)
        t = host[:32]
        m = host.view(torch.int32)[63:69]  # its first word is the last half of t[31]
        m[:] = _sparse_of([1, 2], 32)
        self._refused(lambda: decode_(m, t), host)

    def test_adjacent_memory_decodes(self) -> None:
        """Sharing a storage is fine as long as the bytes do not overlap."""
        host = torch.zeros(100)
        msg = _sparse_of([1, -3], 50)
        m = _plant(host, 50, msg)
        decode_(m, host[:50])
        host[50:] = 0.0
        m = _plant(host, 44, msg)
        decode_(m, host[50:])
        assert host[[0, 2, 50, 52]].tolist() == [0.5, -0.5, 0.5, -0.5]
        assert torch.equal(m, msg)

    @pytest.mark.parametrize("path", [contextlib.nullcontext, torch_path])
    def test_fused_sums_refuse_messages_in_out_params_or_scratch(
        self, path: Callable[[], contextlib.AbstractContextManager[None]]
    ) -> None:
        n = 64
        good = _sparse_of([1, 2, 5], n)
        with path():
            out = torch.zeros(n)
            m = _plant(out, 40, good)
            self._refused(lambda: codec.decode_sum_([good, m], out, names=["a", "b"]), out)
            params, scratch = torch.ones(n), torch.zeros(n)
            m = _plant(params, 40, good)
            self._refused(lambda: codec.subtract_sum_([m], params, scratch), params, scratch)
            params = torch.ones(n)
            m = _plant(scratch, 40, good)
            self._refused(lambda: codec.subtract_sum_([m], params, scratch), params, scratch)

    @pytest.mark.parametrize("path", [contextlib.nullcontext, torch_path])
    def test_scratch_sharing_params_is_refused(
        self, path: Callable[[], contextlib.AbstractContextManager[None]]
    ) -> None:
        n = 64
        host = torch.zeros(n + 8)
        params, scratch = host[:n], host[8:]
        host[:] = 1.0
        host[8:] = 0.0
        before = bits(host).clone()
        with path(), pytest.raises(ValueError, match="`scratch` and `params` in separate"):
            codec.subtract_sum_([_sparse_of([1, 2], n)], params, scratch)
        assert torch.equal(bits(host), before)


def _mixed_messages(n: int, kinds: str, dtype: torch.dtype, seed: int) -> list[torch.Tensor | None]:
    """One message per letter of ``kinds`` (s: sparse, b: bitmap, -: None) for N = ``n``."""
    g = torch.Generator().manual_seed(seed)
    out: list[torch.Tensor | None] = []
    for k in kinds:
        r = (torch.randn(n, generator=g) * 2).to(dtype)
        out.append(
            None if k == "-" else encode_sparse_(r, 1.0) if k == "s" else encode_bitmap_(r, 0.7)
        )
    return out


def _reference_sum(messages: list[torch.Tensor | None], n: int, dtype: torch.dtype, divisor: float):
    total = torch.zeros(n, dtype=dtype)
    for m in messages:
        if m is not None:
            decode_(m, total)
    return total.div_(divisor)


class TestFusedSums:
    """decode_sum_ / subtract_sum_ equal zero, decode each in order, divide (and subtract),
    bit for bit, on the kernels and on the torch path; a bad message changes nothing."""

    @pytest.mark.parametrize("n", [5, 17, 65536, 3 * 65536 + 77])
    @pytest.mark.parametrize("kinds", ["sss", "s-bs", "b", "", "bb", "-s"])
    @pytest.mark.parametrize("dtype", FLOATS)
    def test_equal_to_decoding_one_by_one(self, n: int, kinds: str, dtype: torch.dtype) -> None:
        messages = _mixed_messages(n, kinds, dtype, seed=n)
        for divisor in (1, 3, 4.0):
            ref = _reference_sum(messages, n, dtype, divisor)
            for path in (contextlib.nullcontext, torch_path):
                with path():
                    out = torch.full((n,), 7.0, dtype=dtype)
                    codec.decode_sum_(messages, out, divisor=divisor)
                    assert torch.equal(bits(out), bits(ref))
                    params = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(dtype)
                    params[0] = -0.0
                    expected = params - ref
                    scratch = torch.zeros(n, dtype=dtype)
                    codec.subtract_sum_(messages, params, scratch, divisor=divisor)
                    assert torch.equal(bits(params), bits(expected))
                    assert torch.equal(bits(scratch), bits(torch.zeros(n, dtype=dtype)))

    def test_overlapping_entries_sum_before_subtracting(self) -> None:
        """Two messages naming one element: p - (t + t), not (p - t) - t."""
        n = 40
        a, b = torch.zeros(n), torch.zeros(n)
        a[[3, 9]], b[[3, 20]] = 0.3, 0.3
        ma, mb = encode_sparse_(a, 0.1), encode_sparse_(b, 0.1)
        params = torch.full((n,), 1.0)
        codec.subtract_sum_([ma, mb], params, torch.zeros(n), divisor=3)
        t = torch.tensor(0.1, dtype=torch.float32)
        assert params[3] == 1.0 - (t + t) / 3 and params[9] == 1.0 - t / 3
        assert params[0] == 1.0

    @pytest.mark.parametrize("fused", ["decode_sum_", "subtract_sum_"])
    def test_bad_message_names_it_and_writes_nothing(self, fused: str) -> None:
        messages = _mixed_messages(300, "sbs", torch.float32, seed=3)
        bad = messages[2]
        assert bad is not None
        bad[6] = bad[5]  # entries no longer ascending
        target = torch.randn(300)
        before = target.clone()
        scratch = torch.zeros(300)
        with pytest.raises(MessageError, match="Message from rank 2 is invalid: Invalid sparse"):
            if fused == "decode_sum_":
                codec.decode_sum_(messages, target, names=["rank 0", "rank 1", "rank 2"])
            else:
                codec.subtract_sum_(messages, target, scratch, names=["rank 0", "rank 1", "rank 2"])
        assert torch.equal(bits(target), bits(before)) and not scratch.any()

    def test_bad_arguments(self) -> None:
        msg, n = _good_sparse()
        with pytest.raises(ValueError, match="divisor"):
            codec.decode_sum_([msg], torch.zeros(n), divisor=0)
        with pytest.raises(ValueError, match="scratch"):
            codec.subtract_sum_([msg], torch.zeros(n), torch.zeros(n, dtype=torch.float64))
        with pytest.raises(MessageError, match="position 0"):
            codec.decode_sum_([msg], torch.zeros(n + 1))

    @pytest.mark.parametrize("divisor", [1e-46, 1e-45, 2.0**-140, 1e39, float("inf")])
    @pytest.mark.parametrize("fused", ["decode_sum_", "subtract_sum_"])
    def test_divisor_outside_float32_is_refused(self, divisor: float, fused: str) -> None:
        """1e-46 rounds to 0 in float32 (a ZeroDivisionError from the kernel); 1e-45 and
        2**-140 have no finite float32 reciprocal and 1e39 rounds to inf (inf or NaN sums)."""
        msg, n = _good_sparse()
        target, scratch = torch.randn(n), torch.zeros(n)
        before = bits(target).clone()
        with pytest.raises(ValueError, match="Expect `divisor` finite and > 0 as a normal float32"):
            if fused == "decode_sum_":
                codec.decode_sum_([msg], target, divisor=divisor)
            else:
                codec.subtract_sum_([msg], target, scratch, divisor=divisor)
        assert torch.equal(bits(target), before) and not scratch.any()

    def test_smallest_normal_divisor_works(self) -> None:
        msg, n = _good_sparse()
        out = torch.zeros(n)
        codec.decode_sum_([msg], out, divisor=float(np.finfo(np.float32).tiny))
        assert torch.isfinite(out).all()

    @pytest.mark.parametrize("names", [["rank 0"], ["rank 0", "rank 1", "rank 2"], []])
    def test_names_not_one_per_message_is_refused(self, names: list[str]) -> None:
        """Too few names were an IndexError, and only when a message was bad."""
        bad = _good_sparse()[0]
        bad[5] = 0
        for messages in ([_good_sparse()[0], bad], [None, None]):
            target = torch.randn(40)
            before = bits(target).clone()
            with pytest.raises(ValueError, match="Expect one name per message in `names`"):
                codec.decode_sum_(messages, target, names=names)
            with pytest.raises(ValueError, match="one name per message"):
                codec.subtract_sum_(messages, target, torch.zeros(40), names=names)
            assert torch.equal(bits(target), before)


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


class TestTakeUpdate:
    """``take_update_``: the update an optimizer step made, checked finite in the same pass."""

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
    @pytest.mark.parametrize("n", [5, (1 << 16) * 3 + 7])
    def test_exact_difference_and_restore(self, dtype: torch.dtype, n: int) -> None:
        g = torch.Generator().manual_seed(n)
        before = torch.randn(n, generator=g).to(dtype)
        after = torch.randn(n, generator=g).to(dtype)
        out = torch.empty_like(before)
        expected = before - after
        codec.take_update_(before, after.clone(), out)
        assert torch.equal(out, expected)
        restored = after.clone()
        codec.take_update_(before, restored, out, restore=True)
        assert torch.equal(out, expected) and torch.equal(restored, before)

    def test_out_may_be_after(self) -> None:
        before, after = torch.arange(8.0), torch.ones(8)
        codec.take_update_(before, after, after)
        assert after.tolist() == [float(i - 1) for i in range(8)]

    @pytest.mark.parametrize("n", [10, 200_000])
    def test_nonfinite_is_named_and_parameters_still_restored(self, n: int) -> None:
        before, after = torch.zeros(n), torch.zeros(n)
        after[n - 3], after[n - 1] = float("nan"), float("inf")
        with pytest.raises(
            ValueError, match=rf"2 non-finite value\(s\), the first at flat index {n - 3}"
        ):
            codec.take_update_(before, after, torch.empty(n), restore=True)
        assert torch.equal(after, before)

    def test_mismatched_buffers_refused(self) -> None:
        with pytest.raises(ValueError, match="like `before`"):
            codec.take_update_(torch.zeros(4), torch.zeros(5), torch.zeros(4))


def test_checked_sum_still_refuses_another_length() -> None:
    """``checked=True`` skips re-validating a process's own messages, never the length check
    that keeps a decode inside its target."""
    message = codec.encode_sparse_(torch.tensor([1.0, -1.0, 0.0, 1.0]), 0.5)
    out = torch.zeros(3)
    with pytest.raises(MessageError, match="N = 4"):
        codec.decode_sum_([message], out, checked=True)
    assert torch.equal(out, torch.zeros(3))
    codec.decode_sum_([message], torch.zeros(4), checked=True)


def _exact_mean_f32(x: torch.Tensor) -> float:
    """float32(float64(mean |x|)) with the sum taken exactly (the magnitudes as float32)."""
    from fractions import Fraction

    mags = x.double().abs().float().double().tolist()
    mean = float(sum((Fraction(v) for v in mags), Fraction(0)) / len(mags))
    return float(np.float32(mean))


class TestMeanMagnitude:
    """``magnitude="mean"``: the header's float is m = float32(mean |x| over the sent elements),
    m >= t, each sent element leaves the residual as exactly ``sign * m`` (computed in the
    residual's dtype) and decoding gives exactly ``±m`` there, so the books stay exact. The
    fused kernels and the torch path agree bit for bit."""

    @pytest.mark.parametrize("fused", [True, False])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
    @pytest.mark.parametrize(
        ("kind", "t", "n"),
        [
            ("sparse", 1.5, 5000),
            ("sparse", 0.5, 3 * CHUNK + 11),  # more than CAP per chunk: the unmoved chunks
            ("boundary", 1.0, 2 * CHUNK + 7),
            ("boundary", 0.3, 3 * CHUNK),
            ("bitmap", 1.0, 3 * CHUNK + 5),
            ("bitmap", 0.7, 1000),
        ],
    )
    def test_exact_books(
        self, kind: str, t: float, n: int, dtype: torch.dtype, fused: bool
    ) -> None:
        x = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 0.8).to(dtype)
        r = x.clone()
        with contextlib.nullcontext() if fused else torch_path():
            if kind == "bitmap":
                msg = encode_bitmap_(r, t, magnitude="mean")
            else:
                limit = n // 100 if kind == "boundary" else None
                msg = encode_sparse_(r, t, limit, magnitude="mean")
        assert msg is not None
        info = message_info(msg)
        m = info.threshold
        sent = decode_(msg, torch.zeros(n, dtype=dtype))
        mask = sent != 0
        crossing = torch.nonzero(x.abs() >= t).view(-1)
        if kind == "boundary":
            crossing = crossing[: n // 100]
        want = torch.zeros(n, dtype=torch.bool)
        want[crossing] = True
        assert torch.equal(mask, want)  # exactly the first `limit` crossing ones, no half steps
        assert info.num_entries == crossing.numel() > 1
        assert m >= t and m == _exact_mean_f32(x[mask])
        mt = torch.tensor(m, dtype=dtype)
        assert torch.equal(sent[mask], torch.sign(x[mask]) * mt)
        assert torch.equal(bits(r[mask]), bits(x[mask] - torch.sign(x[mask]) * mt))
        assert torch.equal(bits(r[~mask]), bits(x[~mask]))
        assert torch.equal(sent + r, sent.double().add(r.double()).to(dtype))  # exact books
        assert torch.equal((sent.double() + r.double()).to(dtype), r + sent)

    def test_default_and_threshold_send_t(self) -> None:
        x = torch.tensor([1.5, 2.5, -3.5])
        a, b = x.clone(), x.clone()
        assert encode_sparse_(a, 0.5).tolist() == [3, 3, 1056964608, 0, 1, 2, -3]  # type: ignore[union-attr]
        assert torch.equal(
            encode_sparse_(b, 0.5, magnitude="threshold"), encode_sparse_(x.clone(), 0.5)
        )  # type: ignore[arg-type]
        c = x.clone()
        msg = encode_sparse_(c, 0.5, magnitude="mean")
        assert msg is not None and message_info(msg).threshold == 2.5
        assert c.tolist() == [-1.0, 0.0, -1.0]

    @pytest.mark.parametrize("value", ["Mean", "t", None, 1])
    def test_bad_magnitude(self, value: object) -> None:
        r = torch.ones(8)
        with pytest.raises(ValueError, match="`magnitude`"):
            encode_sparse_(r, 0.5, magnitude=value)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="`magnitude`"):
            encode_bitmap_(r, 0.5, magnitude=value)  # type: ignore[arg-type]
        assert torch.equal(r, torch.ones(8))

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
        x = torch.tensor(vals * 40000, dtype=torch.float32)
        for encode in (
            lambda r: encode_sparse_(r, 1.0, magnitude="mean"),
            lambda r: encode_sparse_(r, 1.0, boundary=777, magnitude="mean"),
            lambda r: encode_bitmap_(r, 1.0, magnitude="mean"),
        ):
            a, b = x.clone(), x.clone()
            ma = encode(a)
            with torch_path():
                mb = encode(b)
            assert ma is not None and mb is not None and torch.equal(ma, mb)
            assert torch.equal(bits(a), bits(b))
            m = message_info(ma).threshold
            assert 3.0 < m < float("inf")

    def test_mean_of_tiny_and_huge_magnitudes_is_exact(self) -> None:
        """Subnormal and near-largest magnitudes in one message: the exponent bins lose nothing."""
        x = torch.tensor([1e-45, -3e-45, 3e38, -3.4e38, 2e-40], dtype=torch.float32)
        for fused in (True, False):
            r = x.clone()
            with contextlib.nullcontext() if fused else torch_path():
                msg = encode_sparse_(r, 1e-45, magnitude="mean")
            assert msg is not None
            assert message_info(msg).threshold == _exact_mean_f32(x)
