"""The wire format (docs/design.md §1): DL4J's vectors, round trips, validation, the public
functions on both paths, and the switch between them. The kernels themselves (equal to the torch
path bit for bit in every way a step can end) are in tests/test_kernels.py."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Callable
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
    _dispatch,
    decode_,
    encode_bitmap_,
    encode_sparse_,
    message_info,
)

from codec_steps import run_steps

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


CHUNK = 1 << 16
"""The kernels' chunk (tests/test_kernels.py checks it): sizes past it span several chunks."""


def torch_path() -> contextlib.AbstractContextManager[None]:
    """Route every codec call through the vectorised torch ops (the CUDA path), even on CPU."""
    return codec.use_kernels(False)


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
        assert msg is not None and msg.numel() - 4 > _dispatch.SMALL
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
    @pytest.mark.parametrize("entries", [10, _dispatch.SMALL + 10])
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


class TestSubtract:
    """``subtract_``: LocalSteps' Δ = (start + carry) - local in one pass, rounded as torch's
    ``add`` then ``sub``, with the non-finite count that names a bad parameter."""

    @pytest.mark.parametrize("n", [5, (1 << 16) * 3 + 7])
    @pytest.mark.parametrize("plus", [False, True])
    def test_exact_as_torch_ops(self, n: int, plus: bool) -> None:
        g = torch.Generator().manual_seed(n)
        before, after, carry = (torch.randn(n, generator=g) * 10**-i for i in range(3))
        out = torch.empty(n)
        extra = carry if plus else None
        assert codec.subtract_(before, after, out, plus=extra) == 0
        expected = (before + carry) - after if plus else before - after
        assert torch.equal(out, expected)

    @pytest.mark.parametrize("n", [10, 200_000])
    def test_nonfinite_counted(self, n: int) -> None:
        before, after, carry = torch.zeros(n), torch.zeros(n), torch.zeros(n)
        after[n - 3], carry[1] = float("nan"), float("inf")
        assert codec.subtract_(before, after, torch.empty(n)) == 1
        assert codec.subtract_(before, after, torch.empty(n), plus=carry) == 2
        big = torch.full((n,), 3e38)
        assert codec.subtract_(big, -big, torch.empty(n)) == n  # overflow to infinity

    @pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch"])
    @pytest.mark.parametrize("n", [5, CHUNK * 3 + 7])
    def test_then_and_out_as_before(self, kernels: bool, n: int) -> None:
        """LocalSteps' carry at a merge: ``base -= local`` (``out`` is ``before``), and the
        replica takes the global copy (``then``) in the same pass."""
        g = torch.Generator().manual_seed(n)
        base, local, glob = (torch.randn(n, generator=g) * 10**-i for i in range(3))
        want, out = base - local, base.clone()
        with codec.use_kernels(kernels):
            assert codec.subtract_(out, local, out, then=glob) == 0
        assert torch.equal(bits(out), bits(want)) and torch.equal(local, glob)

    def test_mismatched_buffers_refused(self) -> None:
        with pytest.raises(ValueError, match="`plus` like `before`"):
            codec.subtract_(torch.zeros(4), torch.zeros(4), torch.zeros(4), plus=torch.zeros(5))


class TestDecayAdd:
    """``decay_add_``: LocalSteps' error feedback with decay in one pass (backup = r,
    d = (start + carry) - local, r = β·r + d), rounded exactly as torch's ``add``, ``sub``,
    ``mul`` and ``add`` round it, on the kernels and on the torch ops alike."""

    @pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch"])
    @pytest.mark.parametrize("n", [5, CHUNK * 3 + 7])
    @pytest.mark.parametrize("plus", [False, True])
    @pytest.mark.parametrize("out", [False, True])
    @pytest.mark.parametrize("factor", [0.95, 1.0, 0.0])
    def test_exact_as_torch_ops(
        self, kernels: bool, n: int, plus: bool, out: bool, factor: float
    ) -> None:
        g = torch.Generator().manual_seed(n)
        start, local, carry, old = (torch.randn(n, generator=g) * 10**-i for i in range(4))
        r, backup, d = old.clone(), torch.empty(n), torch.full((n,), 7.0)
        with codec.use_kernels(kernels):
            extra, into = carry if plus else None, d if out else None
            bad = codec.decay_add_(r, factor, backup, start, local, plus=extra, out=into)
        delta = ((start + carry) - local) if plus else (start - local)
        assert bad == 0
        assert torch.equal(bits(backup), bits(old))
        assert torch.equal(bits(r), bits(old.mul(factor).add_(delta)))
        assert torch.equal(d, delta if out else torch.full((n,), 7.0))

    @pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch"])
    def test_nonfinite_counted_and_backup_whole(self, kernels: bool) -> None:
        n = CHUNK + 10
        start, local, carry = torch.zeros(n), torch.zeros(n), torch.zeros(n)
        local[n - 3], carry[1] = float("nan"), float("inf")
        old = torch.arange(n, dtype=torch.float32)
        r, backup = old.clone(), torch.empty(n)
        with codec.use_kernels(kernels):
            assert codec.decay_add_(r, 0.5, backup, start, local, plus=carry) == 2
            assert torch.equal(backup, old)  # what a failed sync puts back
            big = torch.full((n,), 3e38)
            assert codec.decay_add_(big.clone(), 1.0, backup, big, -big) == n  # overflow

    def test_mismatched_buffers_refused(self) -> None:
        x = torch.zeros(4)
        with pytest.raises(ValueError, match="`backup` like `residual`"):
            codec.decay_add_(x, 0.95, torch.zeros(5), x, x)
        with pytest.raises(ValueError, match="`out` like `residual`"):
            codec.decay_add_(x, 0.95, x.clone(), x, x, out=torch.zeros(4, dtype=torch.float64))
        assert torch.equal(x, torch.zeros(4))


class TestDecayInto:
    """``decay_into_`` and the sample of either: the new residual written beside the old one
    (which stays as it was: the backup, swapped by the caller), and ``|new|`` at a threshold
    algorithm's sample positions, in the same pass; the bits of torch's ops on both paths, in
    a chunk's tail and across chunks."""

    @pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch"])
    @pytest.mark.parametrize("n", [5, 17, CHUNK + 17, CHUNK * 3 + 7])
    @pytest.mark.parametrize("carry", [False, True])
    @pytest.mark.parametrize("span", [(0, 1), (3, 7), (41, 4096)])
    def test_exact_as_torch_ops(
        self, kernels: bool, n: int, carry: bool, span: tuple[int, int]
    ) -> None:
        g = torch.Generator().manual_seed(n)
        start, local, extra, old = (torch.randn(n, generator=g) * 10**-i for i in range(4))
        first, stride = span[0] % n, span[1]
        r, into, d, sent = old.clone(), torch.full((n,), 5.0), torch.empty(n), torch.empty(n)
        m = torch.empty(len(range(first, n, stride)))
        with codec.use_kernels(kernels):
            bad = codec.decay_into_(
                r,
                0.95,
                into,
                start,
                local,
                plus=extra if carry else None,
                out=d,
                sample=(m, first, stride),
                copy=sent,
            )
        delta = ((start + extra) - local) if carry else (start - local)
        new = old.mul(0.95).add_(delta)
        assert bad == 0 and torch.equal(bits(r), bits(old)) and torch.equal(sent, local)
        assert torch.equal(bits(into), bits(new)) and torch.equal(bits(d), bits(delta))
        assert torch.equal(bits(m), bits(new[first::stride].abs()))

    @pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch"])
    def test_sample_in_place_and_nonfinite(self, kernels: bool) -> None:
        n = 2 * CHUNK + 3
        start, local = torch.randn(n), torch.randn(n)
        local[[9, n - 1]] = float("nan")
        r, backup = torch.randn(n), torch.empty(n)
        old = r.clone()
        m = torch.empty(len(range(2, n, 5)))
        with codec.use_kernels(kernels):
            assert codec.decay_add_(r, 0.5, backup, start, local, sample=(m, 2, 5)) == 2
        assert torch.equal(bits(backup), bits(old))
        assert torch.equal(bits(m), bits(r[2::5].abs()))

    def test_bad_arguments_refused(self) -> None:
        x = torch.zeros(8)
        with pytest.raises(ValueError, match="memory of its own"):
            codec.decay_into_(x, 0.95, x[:8], x.clone(), x.clone())
        with pytest.raises(ValueError, match="vector of 3 elements"):
            codec.decay_into_(x, 0.95, x.clone(), x, x, sample=(torch.empty(2), 1, 3))
        with pytest.raises(ValueError, match="`stride` >= 1"):
            codec.decay_add_(x, 0.95, x.clone(), x, x, sample=(torch.empty(2), 0, 0))


def _sgd_step(params: torch.Tensor, mean: torch.Tensor, lr: float) -> torch.Tensor:
    """torch's own plain SGD step of ``params`` with ``mean`` as the gradient (a copy)."""
    p = params.clone()
    p.grad = mean.to(p.dtype)
    torch.optim.SGD([p], lr=lr).step()
    return p.detach()


class TestStepSum:
    """``step_sum_``: plain SGD with the mean of messages as its gradient, where the sparse
    messages' elements alone are touched, gives torch's own step bit for bit (one fused
    multiply-add per element, ``-0.0`` kept), on both paths, in tails and across chunks."""

    @pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch"])
    @pytest.mark.parametrize("n", [5, 17, CHUNK + 17, CHUNK * 3 + 7])
    @pytest.mark.parametrize("world", [1, 2, 3])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
    def test_equals_torch_sgd(self, kernels: bool, n: int, world: int, dtype: torch.dtype) -> None:
        g = torch.Generator().manual_seed(n + world)
        messages = []
        for r in range(world):
            x = torch.randn(n, generator=g)
            if r:  # some entries cancel: their mean is +0.0
                x[: n // 3] = -messages[0][1][: n // 3]
            t = float(x.abs().sort().values[-max(2, n // 25)])
            messages.append((codec.encode_sparse_(x.clone(), t), x))
        sent = [m for m, _ in messages]
        params = (torch.randn(n, generator=g) * 0.1).to(dtype)
        params[[0, n - 1]] = -0.0
        mean = torch.zeros(n)
        codec.decode_sum_(sent, mean, divisor=world)
        for lr in (2.8, 1 / 3):
            want = _sgd_step(params, mean, lr)
            got, scratch = params.clone(), torch.zeros(n)
            with codec.use_kernels(kernels):
                bad = codec.step_sum_(sent, got, scratch, lr=lr, divisor=world)
            assert bad == 0 and torch.equal(bits(got), bits(want))

    @pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch"])
    def test_bitmap_pieces_and_overflow(self, kernels: bool) -> None:
        """A bitmap (or dense) piece decodes the mean in full into ``scratch`` and steps every
        element; values that overflow are counted."""
        n = CHUNK + 100
        x = torch.randn(n)
        sent = [codec.encode_bitmap_(x.clone(), 0.5), codec.encode_sparse_(x.clone(), 2.0)]
        params, mean = torch.randn(n), torch.zeros(n)
        codec.decode_sum_(sent, mean, divisor=2)
        got, scratch = params.clone(), torch.zeros(n)
        with codec.use_kernels(kernels):
            assert codec.step_sum_(sent, got, scratch, lr=1.4, divisor=2) == 0
        assert torch.equal(bits(got), bits(_sgd_step(params, mean, 1.4)))
        assert torch.equal(scratch, mean)
        big = torch.full((n,), 3e38)
        with codec.use_kernels(kernels):
            stepped = codec.step_sum_(sent[1:], big, torch.zeros(n), lr=3e38, divisor=2)
        assert stepped == int((big.abs() == float("inf")).sum()) > 0

    def test_refuses_an_lr_torch_refuses_and_bad_messages(self) -> None:
        x = torch.zeros(4)
        with pytest.raises(ValueError, match=r"`lr` >= 0 and finite in torch\.float32"):
            codec.step_sum_([], x, torch.zeros(4), lr=1e42)
        bad = codec.encode_sparse_(torch.tensor([1.0, -1.0, 0.0, 1.0]), 0.5)
        assert bad is not None
        bad[-1] = 9
        with pytest.raises(MessageError, match="outside"):
            codec.step_sum_([bad], x, torch.zeros(4), lr=1.0)
        assert torch.equal(x, torch.zeros(4))


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

    def test_mean_of_tiny_and_huge_magnitudes_is_exact(self) -> None:
        """Subnormal and near-largest magnitudes in one message: the exponent bins lose nothing."""
        x = torch.tensor([1e-45, -3e-45, 3e38, -3.4e38, 2e-40], dtype=torch.float32)
        for fused in (True, False):
            r = x.clone()
            with contextlib.nullcontext() if fused else torch_path():
                msg = encode_sparse_(r, 1e-45, magnitude="mean")
            assert msg is not None
            assert message_info(msg).threshold == _exact_mean_f32(x)


class TestUseKernels:
    """``use_kernels`` and ``GRADSHARE_KERNELS``: the one supported switch to the torch ops."""

    def test_block_switches_and_restores(self) -> None:
        before = codec.kernels_enabled()
        with codec.use_kernels(False):
            assert not codec.kernels_enabled()
            with codec.use_kernels(True):
                assert codec.kernels_enabled()
            assert not codec.kernels_enabled()
        assert codec.kernels_enabled() == before

    def test_restored_after_an_error(self) -> None:
        before = codec.kernels_enabled()
        with pytest.raises(RuntimeError, match="inside"), codec.use_kernels(not before):
            raise RuntimeError("inside")
        assert codec.kernels_enabled() == before

    def test_not_a_bool_is_refused(self) -> None:
        before = codec.kernels_enabled()
        with pytest.raises(TypeError, match="`enabled` to be a bool, got int"):
            with codec.use_kernels(0):  # type: ignore[arg-type]
                pass
        assert codec.kernels_enabled() == before

    def test_environment_runs_everything_on_torch_without_numba(self, tmp_path: Path) -> None:
        """``GRADSHARE_KERNELS=0``: every codec step gives the kernels' results bit for bit, and
        numba is never imported (not even to validate a message past the serial-decode size)."""
        script = (
            "import sys, torch\n"
            f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            "from gradshare import codec\n"
            "from codec_steps import run_steps\n"
            "assert not codec.kernels_enabled()\n"
            "out = run_steps()\n"
            "assert 'numba' not in sys.modules, 'numba imported'\n"
            f"torch.save(out, {str(tmp_path / 'torch.pt')!r})\n"
        )
        env = dict(os.environ, GRADSHARE_KERNELS="0")
        done = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stderr[-3000:]
        with codec.use_kernels(True):
            want = run_steps()
        got = torch.load(tmp_path / "torch.pt")
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype and torch.equal(bits(a), bits(b))

    @pytest.mark.parametrize("value", ["no", "2", "false"])
    def test_bad_environment_value_is_named(self, value: str) -> None:
        env = dict(os.environ, GRADSHARE_KERNELS=value)
        done = subprocess.run(
            [sys.executable, "-c", "import gradshare"], env=env, capture_output=True, text=True
        )
        assert done.returncode != 0
        want = (
            f"Expect GRADSHARE_KERNELS to be 0 (torch ops only) or 1 (the default), got {value!r}"
        )
        assert want in done.stderr


class TestDensePiece:
    """Format 3, gradshare's own: the float32 values themselves, for a vector too small for a
    threshold message. Exact bytes, validated whole, and every decoder reads it alike on the
    kernels and on the torch path."""

    def test_exact_bytes_and_the_residual_sent_whole(self) -> None:
        residual = torch.tensor([1.5, -2.0, 0.0])
        message = codec.encode_dense_(residual)
        assert message.tolist() == [3, 3, 0, 3, 1069547520, -1073741824, 0]
        assert torch.equal(bits(residual), bits(torch.zeros(3)))
        info = message_info(message)
        got = (info.format_name, info.num_entries, info.numel, info.threshold)
        assert got == ("dense", 2, 3, 0.0)
        assert info.nbytes == 4 * codec.dense_length(3) == 28

    @pytest.mark.parametrize("path", [contextlib.nullcontext, torch_path])
    def test_every_decoder_adds_the_values(self, path: Callable[[], object]) -> None:
        from gradshare.codec import multipart

        a = torch.tensor([0.1, -3.0, 2.5e-8])
        b = torch.tensor([0.2, 1.0, -1e30])
        ma, mb = codec.encode_dense_(a.clone()), codec.encode_dense_(b.clone())
        with path():  # type: ignore[attr-defined]
            assert torch.equal(decode_(ma, torch.ones(3)), torch.ones(3) + a)
            out = torch.full((3,), 7.0)
            codec.decode_sum_([ma, mb], out, divisor=3)
            assert torch.equal(bits(out), bits((a + b) / 3))
            params = torch.ones(3)
            codec.subtract_sum_([ma, None, mb], params, torch.zeros(3), divisor=2)
            assert torch.equal(bits(params), bits(torch.ones(3) - (a + b) / 2))
            pieces = multipart.split_message(torch.cat([ma, mb]), [3, 3], "rank 1", ["a", "b"])
            assert all(torch.equal(p, m) for p, m in zip(pieces, (ma, mb), strict=True))

    def test_faults_are_named_and_nothing_is_written(self) -> None:
        good = codec.encode_dense_(torch.tensor([1.0, 2.0]))
        nan = good.clone()
        nan[5] = torch.tensor([float("nan")]).view(torch.int32)
        cases = {
            "holds a non-finite value at element 1": nan,
            "Dense header must be [N, N, 0, 3]": torch.cat([good, good[-1:]]),
            "got [2, 2, 5, 3]": good.clone().index_fill_(0, torch.tensor([2]), 5),
        }
        for text, message in cases.items():
            target = torch.ones(2)
            with pytest.raises(MessageError, match=re.escape(text)):
                decode_(message, target)
            with pytest.raises(MessageError, match=re.escape(text)):
                codec.check_message(message, 2)
            assert torch.equal(target, torch.ones(2))
        with pytest.raises(MessageError, match="vector has 3"):
            decode_(good, torch.zeros(3))
        with pytest.raises(ValueError, match="non-finite"):
            codec.encode_dense_(torch.tensor([1.0, float("inf")]))
