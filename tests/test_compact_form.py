"""The compact form of a sparse message (gradshare.codec.compact_form): lossless, its exact
bytes (those of a plain reading of the format), never longer than the sparse message, read by
every decoder, and validated whole; on the kernels and on the torch path alike."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradshare import codec
from gradshare.codec import (
    COMPACT_ENCODING,
    FLEXIBLE_ENCODING,
    MessageError,
    compact_message,
    decode_,
    decode_sum_,
    encode_sparse_,
    expand_message,
    message_info,
)
from gradshare.codec.multipart import join_messages, split_message


@pytest.fixture(params=[True, False], ids=["kernels", "torch"], autouse=True)
def _path(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test runs once on the kernels and once on the torch ops."""
    with codec.use_kernels(request.param):
        yield


def _sparse(n: int, index: list[int], signs: list[int] | None = None, t: float = 0.5):
    """A sparse message of ±t at ``index`` (ascending) for n elements, made by the encoder."""
    residual = torch.zeros(n)
    residual[index] = torch.tensor(signs or [1] * len(index), dtype=torch.float32)
    return encode_sparse_(residual, t)


def _random_sparse(n: int, density: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    residual = torch.randn(n, generator=g)
    residual[torch.rand(n, generator=g) > density] = 0
    return encode_sparse_(residual, 1e-6)


def _payload(message: torch.Tensor) -> list[int]:
    return message[5:].view(torch.uint8)[: int(message[4])].tolist()


def _bits_of(payload: list[int]) -> list[int]:
    return [b >> i & 1 for b in payload for i in range(8)]


def _write(entries: list[int], r: int) -> list[int]:
    """The payload of ``entries`` at r as docs/wire-format.md states the form."""
    gaps = [abs(e) - abs(p) for e, p in zip(entries, [0, *entries[:-1]], strict=True)]
    signs = [int(e < 0) for e in entries]
    lows = [(g - 1) >> i & 1 for g in gaps for i in range(r)]
    highs = [bit for g in gaps for bit in [0] * ((g - 1) >> r) + [1]]
    out = [r]
    for part in (signs, lows, highs):
        part = part + [0] * (-len(part) % 8)
        out += [
            sum(bit << i for i, bit in enumerate(part[j : j + 8])) for j in range(0, len(part), 8)
        ]
    return out


def _as_the_format_writes(entries: list[int]) -> list[int]:
    """The payload at the least r of the fewest bytes (of all r, 0 to 30)."""
    k, x = len(entries), np.diff(np.abs(entries), prepend=0) - 1

    def size(r: int) -> int:
        return 1 + -(-k // 8) + -(-k * r // 8) + -(-(int((x >> r).sum()) + k) // 8)

    return _write(entries, min(range(31), key=lambda r: (size(r), r)))


class TestForm:
    def test_exact_bytes(self) -> None:
        """Gaps 1 (first entry at index 0), 127, 128, 254, 255 and 173: r = 6 (9 bytes; r = 5
        and 7 take 10); low parts 0, 62, 63, 61, 62, 44; high parts 0, 1, 1, 3, 3, 2."""
        index = [0, 127, 255, 509, 764, 937]
        signs = [1, -1, 1, 1, -1, 1]
        sparse = _sparse(2000, index, signs)
        small = compact_message(sparse)
        assert small[:5].tolist() == [6, 2000, sparse[2].item(), COMPACT_ENCODING, 9]
        assert _payload(small) == [6, 0b10010, 128, 255, 247, 62, 11, 21, 145]
        assert small.numel() == 5 + 3 and small[5:].view(torch.uint8)[9:].tolist() == [0] * 3
        assert torch.equal(expand_message(small, 2000), sparse)

    @pytest.mark.parametrize("density", [0.002, 0.0156, 0.04, 0.2, 1.0])
    def test_lossless_never_longer_and_as_the_format_writes(self, density: float) -> None:
        sparse = _random_sparse(20_000, density, seed=int(density * 1e4))
        small = compact_message(sparse)
        want = _as_the_format_writes(sparse[4:].tolist())
        if 5 + (len(want) + 3) // 4 < sparse.numel():
            assert int(small[3]) == COMPACT_ENCODING and _payload(small) == want
            assert torch.equal(expand_message(small, sparse[1].item()), sparse)
        else:
            assert small is sparse
        assert small.numel() <= sparse.numel()

    def test_bits_per_entry_at_four_percent(self) -> None:
        """Uniform entries at 4 %: r = 4, 6 bits plus 1.08 for the high parts (0.96^16 = 0.52
        of the gaps reach 16, 0.52^2 reach 32, ...), against the gaps' entropy and sign, 7.06."""
        sparse = _random_sparse(1_000_000, 0.04, seed=0)
        k = sparse.numel() - 4
        small = compact_message(sparse)
        assert _payload(small)[0] == 4
        assert 7.06 < 32 * small.numel() / k < 7.12

    def test_bitmaps_and_empty_messages_stay(self) -> None:
        bitmap = codec.encode_bitmap_(torch.ones(64), 0.5)
        assert compact_message(bitmap) is bitmap
        empty = torch.tensor([0, 10, 1056964608, FLEXIBLE_ENCODING], dtype=torch.int32)
        assert compact_message(empty) is empty


class TestDecoders:
    def test_every_decoder_reads_it_as_the_sparse_message(self) -> None:
        sparse = _random_sparse(5000, 0.05, seed=3)
        small = compact_message(sparse)
        assert int(small[3]) == COMPACT_ENCODING
        base = torch.randn(5000)
        want = decode_(sparse, base.clone())
        assert torch.equal(decode_(small, base.clone()), want)
        other = compact_message(_random_sparse(5000, 0.05, seed=4))
        out = torch.empty(5000)
        decode_sum_([small, None, other], out, divisor=2)
        ref = torch.empty(5000)
        decode_sum_([sparse, None, expand_message(other, 5000)], ref, divisor=2)
        assert torch.equal(out, ref)
        decode_sum_([small, other], out, checked=True)
        decode_sum_([sparse, expand_message(other, 5000)], ref, checked=True)
        assert torch.equal(out, ref)
        info = message_info(small)
        assert (info.format_name, info.num_entries, info.numel, info.nbytes) == (
            "compact",
            sparse.numel() - 4,
            5000,
            4 * small.numel(),
        )

    def test_multipart_pieces_come_back_sparse(self) -> None:
        a, b = _random_sparse(3000, 0.04, seed=5), _random_sparse(50, 1.0, seed=6)
        joined = join_messages(
            [compact_message(a), None, compact_message(b)],
            [3000, 7, 50],
            [0.5] * 3,
            torch.device("cpu"),
        )
        pieces = split_message(joined, [3000, 7, 50], "rank 1", ["w", "b", "c"])
        assert torch.equal(pieces[0], a) and pieces[1] is None and torch.equal(pieces[2], b)
        broken = joined.clone()
        broken[4] += 4  # L: the piece would run 1 word longer
        with pytest.raises(MessageError, match=r"rank 1, piece of parameter w .*compact"):
            split_message(broken, [3000, 7, 50], "rank 1", ["w", "b", "c"])

    def test_multipart_refuses_a_bad_piece(self) -> None:
        """LocalSteps decodes the split's pieces unchecked: the split validates each whole."""
        a = _random_sparse(3000, 0.04, seed=5)
        joined = join_messages(
            [compact_message(a), None], [3000, 7], [0.5] * 2, torch.device("cpu")
        )
        joined[5:].view(torch.uint8)[0] = 31
        with pytest.raises(MessageError, match=r"rank 1, piece of parameter w .* r = 31"):
            split_message(joined, [3000, 7], "rank 1", ["w", "b"])


def _good() -> torch.Tensor:
    return compact_message(_sparse(2000, [0, 127, 255, 509, 764, 937], [1, -1, 1, 1, -1, 1]))


class TestValidation:
    """Each fault is named and the target is left bit for bit as it was."""

    def _rejects(self, message: torch.Tensor, numel: int, match: str) -> None:
        target = torch.randn(numel)
        before = target.clone()
        with pytest.raises(MessageError, match=match):
            decode_(message, target)
        assert torch.equal(target, before)
        with pytest.raises(MessageError, match=match):
            codec.check_message(message, numel)

    def _with(self, **at: int) -> torch.Tensor:
        message = _good()
        for where, value in at.items():
            message[int(where[1:])] = value
        return message

    def test_header(self) -> None:
        self._rejects(_good(), 1999, "N = 2000 elements, but the vector has 1999")
        self._rejects(self._with(w0=0), 2000, "K = 0 entries")
        self._rejects(self._with(w4=13), 2000, "L = 13 bytes take")
        self._rejects(self._with(w2=0), 2000, "finite threshold > 0")
        self._rejects(_good()[:5].clone(), 2000, "L = 9 bytes take")
        self._rejects(_good()[:4].clone(), 2000, "4 words, fewer than its 5 header words")

    def _payload_set(self, at: int, value: int) -> torch.Tensor:
        message = _good()
        message[5:].view(torch.uint8)[at] = value
        return message

    def test_payload(self) -> None:
        """_good's payload: r = 6, signs in byte 1, low parts in bytes 2-6 (36 bits), high
        parts in bytes 7-8 (16 bits, 6 ones)."""
        self._rejects(self._payload_set(9, 1), 2000, "bytes past L = 9 are set")
        self._rejects(self._payload_set(0, 31), 2000, "byte 0 says r = 31 low bits per gap")
        self._rejects(self._payload_set(0, 20), 2000, "its 9 bytes are too few")
        self._rejects(self._payload_set(1, 0b1010010), 2000, "spare sign bits of byte 1")
        self._rejects(self._payload_set(6, 11 | 16), 2000, "spare low-part bits of byte 6")
        self._rejects(self._payload_set(8, 0), 2000, "its last byte is zero")
        self._rejects(
            self._payload_set(7, 21 | 2), 2000, "hold 7 one bits, but the header says K = 6"
        )
        self._rejects(self._payload_set(7, 5), 2000, "hold 5 one bits")
        message = _good()
        message[1] = 937
        self._rejects(message, 937, "last entry is at index 937, past N = 937")

    def test_a_gap_past_n(self) -> None:
        """A high part that would pass N shifted by r is refused before it is summed (it
        could pass int64); a last index past N, after."""
        words = [3, 100, _good()[2].item(), COMPACT_ENCODING, 4, 0]
        message = torch.tensor(words, dtype=torch.int32)
        message[5:].view(torch.uint8)[:4] = torch.tensor([2, 0, 0, 0x83], dtype=torch.uint8)
        assert expand_message(message, 100)[4:].tolist() == [1, 2, 23]  # q = 0, 0, 5 at r = 2
        message[1] = 22
        self._rejects(message, 22, "last entry is at index 22, past N = 22")
        message[1] = 19
        self._rejects(message, 19, "a gap passes N = 19")

    def test_longer_than_its_sparse_message(self) -> None:
        message = compact_message(_sparse(10_000, [0, 5000]))
        assert int(message[3]) == FLEXIBLE_ENCODING  # 2 entries: stays sparse
        words = [2, 10_000, message[2].item(), COMPACT_ENCODING, 20] + [0] * 5
        long = torch.tensor(words, dtype=torch.int32)
        long[5:].view(torch.uint8)[[19]] = 1
        self._rejects(long, 10_000, "no fewer than the 6 of the sparse message")


def _as_the_format_reads(payload: list[int], k: int, numel: int) -> list[int] | None:
    """The signed 1-based entries of compact bytes read as docs/wire-format.md states the
    form, or None where it breaks a rule of the payload."""
    r = payload[0]
    nsign, nlow = -(-k // 8), -(-k * r // 8)
    if r > 30 or 1 + nsign + nlow >= len(payload) or payload[-1] == 0:
        return None
    signs = _bits_of(payload[1 : 1 + nsign])
    lows = _bits_of(payload[1 + nsign : 1 + nsign + nlow])
    highs = _bits_of(payload[1 + nsign + nlow :])
    if any(signs[k:]) or any(lows[k * r :]) or sum(highs) != k:
        return None
    entries, pos, q = [], 0, 0
    for bit in highs:
        if not bit:
            q += 1
            continue
        j = len(entries)
        pos += (q << r) + sum(lows[j * r + i] << i for i in range(r)) + 1
        entries.append(-pos if signs[j] else pos)
        q = 0
    return None if pos > numel else entries


def test_every_short_payload_as_the_format_says() -> None:
    """Every payload of r in 0, 1, 2, 31 and 1 to 3 more bytes of 0, 1, 2, 0x41, 0x80, 0xFF,
    as K = 3, 4 or 9 entries, for N within and past its reach: expanded to exactly the entries
    the format says, or refused where it breaks a rule; what is accepted ascends strictly
    within 1..N."""
    alphabet = [0, 1, 2, 0x41, 0x80, 0xFF]
    rest = itertools.chain.from_iterable(itertools.product(alphabet, repeat=n) for n in (1, 2, 3))
    for tail in rest:
        for r, k in itertools.product((0, 1, 2, 31), (3, 4, 9)):
            payload = [r, *tail]
            raw = bytes(payload) + bytes(-len(payload) % 4)
            words = torch.frombuffer(bytearray(raw), dtype=torch.int32)
            for numel in (9, 400):
                header = [k, numel, 1056964608, COMPACT_ENCODING, len(payload)]
                message = torch.cat([torch.tensor(header, dtype=torch.int32), words])
                want = _as_the_format_reads(payload, k, numel)
                try:
                    got = expand_message(message, numel)[4:].tolist()
                except MessageError:
                    got = None
                assert got == want, (payload, k, numel)
                if got is not None:
                    index = [abs(e) for e in got]
                    assert all(0 < a < b <= numel for a, b in itertools.pairwise(index))


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)  # the path: one per run
@given(data=st.binary(min_size=1, max_size=16), n=st.integers(1500, 2100))
def test_fuzz_only_message_error(data: bytes, n: int) -> None:
    """Mutated compact messages: decode adds the message or raises MessageError leaving the
    target bit for bit as it was."""
    raw = bytearray(_good().numpy().tobytes())
    for i, b in enumerate(data):
        raw[(i * 7919 + b) % len(raw)] ^= 1 << (b % 8)
    message = torch.from_numpy(np.frombuffer(bytes(raw), dtype=np.int32).copy())
    target = torch.randn(n)
    before = target.clone()
    try:
        decode_(message, target)
    except MessageError:
        assert torch.equal(target, before)


def test_kernel_and_torch_path_agree_on_flipped_bits() -> None:
    """Compact payloads of 300 entries at r 0 to 9 with one to three bits flipped: the kernel
    accepts exactly what the torch path accepts, with the same entries (the kernel's refusal
    alone would be hidden: the torch path then reads the message to name its fault)."""
    from gradshare.codec import _torch_paths
    from gradshare.codec._dispatch import kernels

    g = torch.Generator().manual_seed(0)
    accepted = 0
    for trial in range(300):
        n = 300 * (1 + trial % 600)  # mean gaps 1 to 600: r 0 to 9
        index = torch.randperm(n, generator=g)[:300].sort().values.tolist()
        signs = (torch.randint(0, 2, (300,), generator=g) * 2 - 1).tolist()
        small = compact_message(_sparse(n, index, signs))
        data = small[5:].view(torch.uint8)[: int(small[4])].clone()
        for _ in range(1 + trial % 3):
            bit = int(torch.randint(0, 8 * data.numel(), (1,), generator=g))
            data[bit // 8] ^= 1 << bit % 8
        out = torch.empty(300, dtype=torch.int32)
        ok = kernels().expand_entries(data.numpy(), out.numpy(), n) == 0
        want = _torch_paths.expand_entries(data, 300, n)
        assert ok == (not isinstance(want, str)), trial
        if ok:
            accepted += 1
            assert torch.equal(out, want)
    assert 0 < accepted < 300
