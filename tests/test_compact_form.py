"""The compact form of a sparse message (gradshare.codec.compact_form): lossless, its exact
bytes, never longer than the sparse message, read by every decoder, and validated whole; on
the kernels and on the torch path alike."""

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


class TestForm:
    def test_exact_bytes_of_gaps_and_escapes(self) -> None:
        """Gaps 1 (first entry at index 0), 127, 128, 254, 255 and 173; signs in bit 7."""
        index = [0, 127, 255, 509, 764, 937]
        signs = [1, -1, 1, 1, -1, 1]
        sparse = _sparse(2000, index, signs)
        small = compact_message(sparse)
        assert small[:5].tolist() == [6, 2000, sparse[2].item(), COMPACT_ENCODING, 11]
        assert _payload(small) == [1, 127 | 128, 0, 1, 0, 127, 0, 0, 128 | 1, 0, 46]
        assert small.numel() == 5 + 3 and small[5:].view(torch.uint8)[11:].tolist() == [0]
        assert torch.equal(expand_message(small, 2000), sparse)

    @pytest.mark.parametrize("density", [0.002, 0.0156, 0.04, 0.2, 1.0])
    def test_lossless_and_never_longer(self, density: float) -> None:
        sparse = _random_sparse(100_000, density, seed=int(density * 1e4))
        small = compact_message(sparse)
        index = sparse[4:].abs().long()
        gaps = torch.diff(index, prepend=torch.zeros(1, dtype=torch.long))
        num_bytes = index.numel() + int(((gaps - 1) // 127).sum())  # an entry + its escapes
        if 5 + (num_bytes + 3) // 4 < sparse.numel():
            assert int(small[3]) == COMPACT_ENCODING and int(small[4]) == num_bytes
            assert torch.equal(expand_message(small, sparse[1].item()), sparse)
        else:
            assert small is sparse
        assert small.numel() <= sparse.numel()

    def test_bits_per_entry_at_four_percent(self) -> None:
        """Uniform entries at 4 %: the expected gap escapes with probability ~0.96^127."""
        sparse = _random_sparse(1_000_000, 0.04, seed=0)
        k = sparse.numel() - 4
        bits = 32 * compact_message(sparse).numel() / k
        assert 8.0 < bits < 8.2

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

    def test_multipart_refuses_an_entry_of_gap_zero(self) -> None:
        """A piece whose first byte was 0x80 passed the split as index 0 (LocalSteps decodes
        the split's pieces unchecked: the kernels dropped it, the torch path wrote element
        N-1); a 2-rank exchange took it without an error."""
        a = _random_sparse(3000, 0.04, seed=5)
        joined = join_messages(
            [compact_message(a), None], [3000, 7], [0.5] * 2, torch.device("cpu")
        )
        joined[5:].view(torch.uint8)[0] = 0x80
        with pytest.raises(MessageError, match=r"rank 1, piece of parameter w .* byte 0 is 0x80"):
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
        self._rejects(_good()[:5].clone(), 2000, "L = 11 bytes take")
        self._rejects(_good()[:4].clone(), 2000, "4 words, fewer than its 5 header words")

    def test_payload(self) -> None:
        message = _good()
        message[5:].view(torch.uint8)[11] = 1
        self._rejects(message, 2000, "bytes past L = 11 are set")
        message = _good()
        message[5:].view(torch.uint8)[10] = 0
        self._rejects(message, 2000, "ends with an escape byte")
        message = _good()
        message[5:].view(torch.uint8)[2] = 5  # an escape turned entry: 7 entries
        self._rejects(message, 2000, "holds 7 entry bytes, but the header says K = 6")
        message = _good()
        message[1] = 937
        self._rejects(message, 937, "last entry is at index 937, past N = 937")

    def test_entry_of_gap_zero(self) -> None:
        """Byte 0x80 (the sign bit, gap 0) expanded to entry 0 as the first byte and to a
        repeated index after an entry; after escapes it is no entry of the format either.
        ``message_info`` called such a message valid."""
        for where in (0, 1, 8):  # the first entry; after an entry; after two escapes
            message = _good()
            message[5:].view(torch.uint8)[where] = 0x80
            fault = f"byte {where} is 0x80, an entry of gap 0"
            self._rejects(message, 2000, fault)
            with pytest.raises(MessageError, match=fault):
                message_info(message)

    def test_longer_than_its_sparse_message(self) -> None:
        message = compact_message(_sparse(10_000, list(range(0, 10_000, 1000))))
        assert int(message[3]) == FLEXIBLE_ENCODING  # too far apart: stays sparse
        words = [2, 10_000, message[2].item(), COMPACT_ENCODING, 20] + [0] * 5
        long = torch.tensor(words, dtype=torch.int32)
        long[5:].view(torch.uint8)[[19]] = 1
        long[5:].view(torch.uint8)[[0]] = 1
        self._rejects(long, 10_000, "no fewer than the 6 of the sparse message")


def _as_the_format_says(payload: list[int], numel: int) -> list[int] | None:
    """The signed 1-based entries of compact bytes read as docs/wire-format.md states the
    form, or None where it breaks a rule of the payload."""
    entries, pos = [], 0
    for b in payload:
        if b == 0:  # an escape
            pos += 127
            continue
        if b & 127 == 0:  # an entry's gap is 1 to 127
            return None
        pos += b & 127
        entries.append(-pos if b & 128 else pos)
    return None if payload[-1] == 0 or pos > numel else entries


def test_every_short_tail_as_the_format_says() -> None:
    """Every tail of 1 to 3 bytes of 0, 1, 2, 0x7F, 0x80, 0x81, 0xFF after 8 entries of gap
    1, for N within and past its reach: expanded to exactly the entries the format says, or
    refused where it breaks a rule; what is accepted ascends strictly within 1..N. The kernel
    and the torch path disagreed on a 0x80 and both let it through."""
    alphabet = [0, 1, 2, 0x7F, 0x80, 0x81, 0xFF]
    tails = itertools.chain.from_iterable(itertools.product(alphabet, repeat=r) for r in (1, 2, 3))
    for tail in tails:
        payload = [1] * 8 + list(tail)
        k = sum(b != 0 for b in payload)
        raw = bytes(payload) + bytes(-len(payload) % 4)
        words = torch.frombuffer(bytearray(raw), dtype=torch.int32)
        for numel in (9, 140, 400):
            header = torch.tensor(
                [k, numel, 1056964608, COMPACT_ENCODING, len(payload)], dtype=torch.int32
            )
            message = torch.cat([header, words])
            want = _as_the_format_says(payload, numel)
            try:
                got = expand_message(message, numel)[4:].tolist()
            except MessageError:
                got = None
            assert got == want, (tail, numel)
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
