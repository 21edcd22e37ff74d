"""The codec's steps as vectorised torch ops (private): the CUDA path and the fallback.

Every function here computes what its fused kernel in :mod:`gradshare.codec._kernels` computes, with
the same IEEE operations per element, so the two paths agree bit for bit (tests/test_kernels.py
checks it). :mod:`gradshare.codec._dispatch` and :mod:`gradshare.codec._workspace` choose between
them: CUDA tensors, float16 and bfloat16 always come here, and so does everything while
:func:`gradshare.codec.use_kernels` is off. float16 and bfloat16 values are computed in float32
and rounded back. Nothing here imports numba.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from gradshare.codec._format import (
    BITMAP_ENCODING,
    DENSE_ENCODING,
    F32_MAX,
    FLEXIBLE_ENCODING,
    HEADER_WORDS,
    NBINS,
    mean_magnitude,
    write_header,
)
from gradshare.codec._format import (
    COMPACT_MAX_R as MAX_R,
)

_NATIVE = (torch.float32, torch.float64)
"""Dtypes computed in their own type; the others are computed in float32."""


def _wide(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype not in _NATIVE else x


def magnitude_bins(x: torch.Tensor) -> np.ndarray:
    """The exponent bins of ``|x|`` (see :func:`gradshare.codec.mean_magnitude`), any device."""
    a = x.detach().abs().clamp(max=F32_MAX).float()
    mant, exp = torch.frexp(a)
    q = (mant * 2.0**24).long()
    bins = torch.zeros(NBINS, dtype=torch.int64, device=x.device)
    bins.index_add_(0, (exp + 149).long(), q)
    return bins.cpu().numpy()


def pack_codes(mag: torch.Tensor, sgn: torch.Tensor) -> torch.Tensor:
    """The ``N//16 + 1`` int32 bitmap words of per-element magnitude and sign bits."""
    n = mag.numel()
    nwords = n // 16 + 1
    codes = torch.zeros(nwords * 16, dtype=torch.int64, device=mag.device)
    codes[:n] = mag.long() | (sgn.long() << 16)
    shifts = torch.arange(16, device=mag.device, dtype=torch.int64)
    words = (codes.view(nwords, 16) << shifts).sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


# --------------------------------------------------------------------------- updates


def count_nonfinite(x: torch.Tensor) -> int:
    return int((~torch.isfinite(x)).sum())


def take_update_(
    before: torch.Tensor, after: torch.Tensor, out: torch.Tensor,
    plus: torch.Tensor | None = None, source: torch.Tensor | None = None,
) -> int:  # fmt: skip
    """``out = (before + plus) - after`` (``before - after`` without ``plus``; then
    ``after = source`` if given); non-finite count of ``out``."""
    if plus is None:
        torch.sub(before, after, out=out)
    else:
        torch.add(before, plus, out=out).sub_(after)
    if source is not None:
        after.copy_(source)
    return count_nonfinite(out)


def decay_add_(
    src: torch.Tensor, factor: float, dst: torch.Tensor, keep: torch.Tensor | None,
    before: torch.Tensor, after: torch.Tensor, plus: torch.Tensor | None,
    out: torch.Tensor | None, sample: tuple[torch.Tensor, int, int] | None = None,
    copy: torch.Tensor | None = None,
) -> int:  # fmt: skip
    """``keep = src`` and ``copy = after`` (if given), ``d = (before + plus) - after`` (into
    ``out`` if given) and ``dst = src * factor + d`` (``dst`` may be ``src``); ``sample = (m,
    start, stride)``: ``m[i] = |dst[start + i * stride]|``. The non-finite count of ``dst``."""
    d = torch.sub(before, after) if plus is None else torch.add(before, plus).sub_(after)
    if out is not None:
        out.copy_(d)
    if copy is not None:
        copy.copy_(after)
    if keep is not None:
        keep.copy_(src)
    torch.mul(src, factor, out=dst).add_(d)
    if sample is not None:
        m, start, stride = sample
        m.copy_(dst[start::stride][: m.numel()].abs())
    return count_nonfinite(dst)


# --------------------------------------------------------------------------- encode


def scan_(
    residual: torch.Tensor, update: torch.Tensor | None, t: float
) -> tuple[torch.Tensor, float]:
    """``residual += update`` (if given); (indices with ``|x| >= t``, ``sum(x*x)``)."""
    if update is not None:
        residual.add_(update)
    x = _wide(residual.detach())
    idx = torch.nonzero(x.abs() >= t).view(-1)
    return idx, float(x.double().square().sum())


def emit_(
    residual: torch.Tensor, idx: torch.Tensor, take: int, t: float, mean: bool
) -> tuple[torch.Tensor, float, float]:
    """Sparse-encode the first ``take`` of the scanned ``idx``; (message, value, change of sumsq).

    Each sent element moves by the value the header carries: t, or with ``mean`` the mean
    magnitude of the sent elements.
    """
    n = residual.numel()
    message = torch.empty(take + HEADER_WORDS, dtype=torch.int32, device=residual.device)
    idx = idx[:take]
    xf = _wide(residual[idx])
    value = mean_magnitude(magnitude_bins(xf), take) if mean else t
    write_header(message, take, n, value, FLEXIBLE_ENCODING)
    pos = xf >= t
    moved = torch.where(pos, xf - value, xf + value)
    residual[idx] = moved.to(residual.dtype)
    message[HEADER_WORDS:] = torch.where(pos, idx + 1, -(idx + 1)).to(torch.int32)
    return message, value, float(moved.double().square().sum() - xf.double().square().sum())


def bitmap_(
    residual: torch.Tensor, t: float, update: torch.Tensor | None, message: torch.Tensor
) -> tuple[int, float]:
    """``residual += update`` (if given), bitmap-encode it into ``message``; (sent, sumsq)."""
    n = residual.numel()
    write_header(message, n, n, t, BITMAP_ENCODING)
    if update is not None:
        residual.add_(update)
    x = _wide(residual.detach())
    half = t / 2
    a = x.abs()
    mag = a >= t
    neg = x < 0
    hneg = ~mag & neg & (a >= half)
    sgn = (mag & neg) | hneg
    step = torch.tensor(t, dtype=x.dtype, device=x.device)
    delta = torch.where(mag, torch.where(neg, -step, step), torch.where(hneg, -step / 2, 0 * step))
    moved = x - delta
    residual.copy_(moved)
    message[HEADER_WORDS:] = pack_codes(mag, sgn)
    return int((mag | hneg).sum()), float(moved.double().square().sum())


def bitmap_mean_(
    residual: torch.Tensor, t: float, update: torch.Tensor | None, message: torch.Tensor
) -> tuple[int, float, float]:
    """:func:`bitmap_` sending the mean magnitude m, no half steps; (sent, m, sumsq)."""
    n = residual.numel()
    if update is not None:
        residual.add_(update)
    x = _wide(residual.detach())
    mag = x.abs() >= t
    hits = int(mag.sum())
    m = mean_magnitude(magnitude_bins(x[mag]), hits) if hits else t
    write_header(message, n, n, m, BITMAP_ENCODING)
    step = torch.tensor(m, dtype=x.dtype, device=x.device)
    neg = mag & (x < 0)
    moved = x - torch.where(mag, torch.where(neg, -step, step), 0 * step)
    residual.copy_(moved)
    message[HEADER_WORDS:] = pack_codes(mag, neg)
    return hits, m, float(moved.double().square().sum())


# --------------------------------------------------------------------------- decode


def _bits(data: torch.Tensor) -> torch.Tensor:
    """The bits of uint8 ``data``, each byte's bit 0 first, as int64 0s and 1s."""
    shifts = torch.arange(8, device=data.device)
    return (data.to(torch.int64).unsqueeze(-1) >> shifts & 1).reshape(-1)


def _pack(bits: torch.Tensor) -> torch.Tensor:
    """:func:`_bits` undone: 8 bits (bit 0 first) to a uint8 byte."""
    weights = 1 << torch.arange(8, device=bits.device)
    return (bits.reshape(-1, 8) * weights).sum(1).to(torch.uint8)


def compact_entries(entries: torch.Tensor, payload: torch.Tensor, limit: int) -> int:
    """What :func:`gradshare.codec._kernels.compact_entries` computes (and its choice of r)."""
    k = entries.numel()
    index = entries.abs().to(torch.int64)  # 1-based: the first entry's gap is from index -1
    gaps = torch.diff(index, prepend=index.new_zeros(1))
    x = gaps - 1
    r, best = 0, 0
    for rr in range(MAX_R + 1):
        high = int((x >> rr).sum())
        size = 1 + (k + 7) // 8 + (k * rr + 7) // 8 + (high + k + 7) // 8
        if rr == 0 or size < best:
            r, best = rr, size
        if high == 0:
            break
    if best > limit:
        return -1
    lows = 1 + (k + 7) // 8
    highs = lows + (k * r + 7) // 8
    bits = torch.zeros(8 * best, dtype=torch.int64, device=entries.device)
    bits[:8] = _bits(torch.tensor([r], dtype=torch.uint8))
    bits[8 : 8 + k] = (entries < 0).to(torch.int64)
    low = (x.unsqueeze(-1) >> torch.arange(r, device=x.device) & 1).reshape(-1)
    bits[8 * lows : 8 * lows + k * r] = low
    bits[8 * highs + torch.cumsum((x >> r) + 1, 0) - 1] = 1
    payload[:best] = _pack(bits)
    return best


def expand_entries(data: torch.Tensor, k: int, numel: int) -> torch.Tensor | str:
    """The signed 1-based int32 entries of the compact bytes ``data``, or the fault."""
    size = data.numel()
    r = int(data[0])
    if r > MAX_R:
        return f"byte 0 says r = {r} low bits per gap; expect 0 to {MAX_R}"
    lows = 1 + (k + 7) // 8
    highs = lows + (k * r + 7) // 8
    if highs >= size:
        return (
            f"its {size} bytes are too few: r and the signs and {r}-bit low parts of K = {k} "
            f"entries take {highs}, and the high parts at least 1 more"
        )
    bits = _bits(data)
    if int(bits[8 + k : 8 * lows].sum()):
        return f"spare sign bits of byte {lows - 1} are set; they must be zero"
    if int(bits[8 * lows + k * r : 8 * highs].sum()):
        return f"spare low-part bits of byte {highs - 1} are set; they must be zero"
    if int(data[-1]) == 0:
        return "its last byte is zero; the last byte holds the K-th entry's high part"
    ones = torch.nonzero(bits[8 * highs :]).reshape(-1)
    if ones.numel() != k:
        return f"its high parts hold {ones.numel()} one bits, but the header says K = {k}"
    high = torch.diff(ones, prepend=ones.new_full((1,), -1)) - 1
    if int(high.max()) > numel >> r:
        return f"a gap passes N = {numel}"
    low_bits = bits[8 * lows : 8 * lows + k * r].reshape(k, r)
    low = (low_bits << torch.arange(r, device=data.device)).sum(1)
    position = torch.cumsum((high << r) + low + 1, 0)  # 1-based indices
    if int(position[-1]) > numel:
        return f"its last entry is at index {int(position[-1]) - 1}, past N = {numel}"
    negative = bits[8 : 8 + k].bool()
    return torch.where(negative, -position, position).to(torch.int32)


def first_bad_sparse(entries: torch.Tensor, numel: int) -> int:
    """Position of the first sparse entry that is 0, outside ±1..±N or not ascending, or -1."""
    a = entries.long().abs()
    prev = torch.cat([a.new_zeros(1), a[:-1]])
    faults = torch.nonzero((a == 0) | (a > numel) | (a <= prev))
    return int(faults[0, 0]) if faults.numel() else -1


def apply_sparse_(entries: torch.Tensor, t: float, target: torch.Tensor) -> None:
    """``target[|e|-1] += sign(e) * t`` for every (validated) entry."""
    e = entries.long()
    idx = e.abs() - 1
    curf = _wide(target[idx])
    target[idx] = torch.where(e > 0, curf + t, curf - t).to(target.dtype)


def apply_bitmap_(words: torch.Tensor, t: float, target: torch.Tensor) -> None:
    """Add the decoded (validated) bitmap ``words`` into ``target``."""
    n = target.numel()
    w = words.to(torch.int64) & 0xFFFFFFFF
    bits = (w.unsqueeze(1) >> torch.arange(32, device=w.device)) & 1
    mag = bits[:, :16].reshape(-1)[:n].bool()
    sgn = bits[:, 16:].reshape(-1)[:n].bool()
    curf = _wide(target.detach())
    step = torch.tensor(t, dtype=curf.dtype, device=curf.device)
    vals = torch.where(mag, torch.where(sgn, -step, step), torch.where(sgn, -step / 2, 0 * step))
    target.copy_((curf + vals).to(target.dtype))


def sum_(
    present: Sequence[tuple[torch.Tensor, int, float]],
    target: torch.Tensor,
    scratch: torch.Tensor | None,
    divisor: float,
) -> None:
    """Decode the validated ``(message, format, t)`` in order into a zeroed buffer, divide it,
    and either leave it in ``target`` or (with ``scratch`` as the buffer) subtract it."""
    buf = target if scratch is None else scratch
    if scratch is None:
        buf.zero_()
    for m, fmt, t in present:
        if fmt == FLEXIBLE_ENCODING:
            apply_sparse_(m[HEADER_WORDS:], t, buf)
        elif fmt == DENSE_ENCODING:
            buf.add_(m[HEADER_WORDS:].view(torch.float32))
        else:
            apply_bitmap_(m[HEADER_WORDS:], t, buf)
    if divisor != 1:
        buf.div_(divisor)
    if scratch is not None:
        target.sub_(buf)
        buf.zero_()
