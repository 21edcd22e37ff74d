"""Fused CPU kernels behind :mod:`gradshare.codec` (private).

Every kernel works on a flat float32 or float64 array split into chunks of :data:`CHUNK`
elements; chunks run in parallel (``prange``) and each chunk walks its elements in superblocks
of :data:`SUPER` or words of 16 so that the inner loops are indexed from 0 and vectorise.

Sparse encoding is speculative, so that one pass over memory does the work and the format can
still be chosen afterwards:

1. :func:`scan` adds the update into the residual (optional), sums ``x*x`` for the residual
   norm, and for every element with ``|x| >= t`` — while its superblock is still in cache —
   records its signed 1-based entry and its old value (up to :data:`CAP` per chunk) and already
   moves it by ``t``. A chunk with more than ``CAP`` qualifying elements puts its moved elements
   back from the recorded old values at once and is left unmoved (``counts[c] > CAP`` marks it).
2. :func:`emit_sparse` copies the recorded entries of the chosen prefix into the message and
   puts back (exactly, from the old values) every recorded element past the prefix; an
   unmoved chunk is rescanned and moves its own share. It touches only what it must undo.
3. When the format turns out to be a bitmap, :func:`encode_bitmap` puts each chunk's recorded
   elements back just before it encodes that chunk (the chunk is then in cache anyway); and
   :func:`undo` puts everything back when no message is sent.

To send the mean magnitude m instead of t (``magnitude="mean"``), :func:`sent_magnitudes` bins
the old values of the sent prefix by exponent (an exact int64 sum, see :func:`_bin_magnitude`)
between (1) and (2), and :func:`emit_sparse` then rewrites each sent element from its old value
moved by m; a bitmap takes :func:`bitmap_magnitudes` and :func:`encode_bitmap_step` instead of
(3). The default path runs none of this.

The superblock step of (1) and of the bitmap encode are small LLVM intrinsics, working on one
vector register at a time (:mod:`gradshare.codec._intrinsics`). Every element sees the same IEEE
operations as the torch path (:mod:`gradshare.codec._torch_paths`), so results are identical bit for
bit.

This module imports numba; :mod:`gradshare.codec._dispatch` imports it on first use only, and numba
compiles each kernel on its first call (cached on disk), so importing gradshare compiles nothing.
"""

from __future__ import annotations

import math
import types as types_

import numpy as np
from numba import njit, prange

from gradshare.codec._format import COMPACT_MAX_R as MAX_R
from gradshare.codec._intrinsics import fma, make_bitmap_superblock, make_superblock, prefetch

CHUNK = 1 << 16
"""Elements per parallel chunk (a multiple of 16, so bitmap words never straddle chunks)."""
SUPER = 256
"""Elements per vectorised superblock inside a chunk."""
CAP = CHUNK // 16
"""Entries recorded per chunk; a chunk with more is left unmoved and rescanned when emitting."""
W = 16
"""Lanes of the superblock intrinsics (one bitmap word, one AVX-512 register of float32)."""
STRIDE = CAP + SUPER + W
"""Record slots per chunk: ``CAP`` plus the slack one superblock's full-width stores may use."""

_OPTS = {"parallel": True, "nogil": True, "cache": True}


def num_chunks(n: int) -> int:
    return (n + CHUNK - 1) // CHUNK


@njit(fastmath={"reassoc"}, nogil=True, cache=True)
def _nonfinite_in(xs):  # pragma: no cover - compiled
    """The non-finite elements of ``xs`` (one chunk, in cache): a vectorised sum of ``x - x``
    (0 for a finite x, NaN otherwise) first, counted element by element only when it is not
    finite."""
    acc = xs[0] - xs[0]
    for j in range(xs.size):
        acc += xs[j] - xs[j]
    bad = 0
    if acc != acc:
        for j in range(xs.size):
            bad += not (abs(xs[j]) < np.inf)
    return bad


@njit(**_OPTS)
def count_nonfinite(x, counts):  # pragma: no cover - compiled
    """Count the non-finite elements of ``x`` per chunk into ``counts``."""
    n = x.size
    for c in prange(counts.size):
        lo = c * CHUNK
        counts[c] = _nonfinite_in(x[lo : min(lo + CHUNK, n)])


@njit(**_OPTS)
def take_update(before, plus, after, out, source, counts):  # pragma: no cover - compiled
    """``out = (before + plus) - after`` (``before - after`` when ``plus`` is None; then
    ``after = source`` unless None), counting per chunk the non-finite elements of ``out``
    into ``counts``: one pass over the arrays (the count and the copy read each chunk again
    in cache). Optional arrays are None, as in :func:`decay_add`.

    No fastmath here: each element sees the same IEEE operations, in the same order, as
    torch's ``add`` then ``sub``; only the count (:func:`_nonfinite_in`) reassociates.
    """
    n = before.size
    for c in prange(counts.size):
        lo = c * CHUNK
        hi = min(lo + CHUNK, n)
        b = before[lo:hi]
        a = after[lo:hi]
        o = out[lo:hi]
        for j in range(hi - lo):
            o[j] = ((b[j] + plus[lo + j]) if plus is not None else b[j]) - a[j]
        if source is not None:
            for j in range(hi - lo):
                a[j] = source[lo + j]
        counts[c] = _nonfinite_in(o)


@njit(**_OPTS)
def decay_add(
    src, factor, dst, keep, before, plus, after, out, copy, sample, start, stride, counts
):  # pragma: no cover - compiled
    """``d = (before + plus) - after`` (``before - after`` when ``plus`` is None; into ``out``
    unless None), ``keep = src`` and ``copy = after`` (unless None) and ``dst = src * factor
    + d``, counting per chunk the non-finite elements of ``dst`` into ``counts``: one pass
    over the arrays, where a difference, a decay and an add would take three. ``dst`` is
    ``src`` itself (the residual decays in place, its old values kept in ``keep``) or another
    array (``src`` is then left as it was). ``sample[i] = |dst[start + i * stride]|`` for
    every ``i`` (none when it is empty), taken while each chunk is in cache.

    The optional arrays are None rather than flagged: numba compiles each combination with
    the unused arrays' code removed, so that every loop vectorises (with flags a third
    slower). No fastmath here: each element sees the same IEEE operations, in the same order,
    as torch's ``add``, ``sub``, ``mul`` then ``add``; only the count (:func:`_nonfinite_in`)
    reassociates. ``src`` is finite, so a non-finite ``d`` leaves its element non-finite.
    """
    n = dst.size
    for c in prange(counts.size):
        lo = c * CHUNK
        hi = min(lo + CHUNK, n)
        rs = src[lo:hi]
        ds = dst[lo:hi]
        b = before[lo:hi]
        a = after[lo:hi]
        for j in range(hi - lo):
            d = ((b[j] + plus[lo + j]) if plus is not None else b[j]) - a[j]
            if out is not None:
                out[lo + j] = d
            if copy is not None:
                copy[lo + j] = a[j]
            v = rs[j]
            if keep is not None:
                keep[lo + j] = v
            ds[j] = v * factor + d
        _sample_chunk(dst, sample, start, stride, lo, hi)
        counts[c] = _nonfinite_in(ds)


@njit(inline="always")
def _sample_chunk(x, sample, start, stride, lo, hi):  # pragma: no cover - compiled
    """``sample[i] = |x[start + i * stride]|`` for the positions in ``lo..hi``."""
    i = 0 if lo <= start else (lo - start + stride - 1) // stride
    g = start + i * stride
    while i < sample.size and g < hi:
        sample[i] = abs(x[g])
        i += 1
        g += stride


_bitmap_add = make_bitmap_superblock(True, SUPER)
_bitmap_in_place = make_bitmap_superblock(False, SUPER)
_super_add_every = make_superblock(True, True, SUPER)
_super_add_sparse = make_superblock(True, False, SUPER)
_super_every = make_superblock(False, True, SUPER)
_super_sparse = make_superblock(False, False, SUPER)


@njit(inline="always")
def _restore(r, ent, old, lo, hi):  # pragma: no cover - compiled
    """Put back the recorded elements ``lo..hi`` (old values) of one chunk."""
    for k in range(lo, hi):
        e = ent[k]
        r[(e if e > 0 else -e) - 1] = old[k]


@njit(fastmath={"reassoc"}, **_OPTS)
def scan(r, u, add, t, counts, ent, old):  # pragma: no cover - compiled
    """Optionally ``r += u``; count, record and move the elements with ``|r| >= t``.

    Returns ``(qualifying elements, sum(r*r) before any move)``. Per chunk ``c``: ``counts[c]``
    qualifying elements; when ``counts[c] <= CAP`` they are moved and recorded in
    ``ent/old[c*STRIDE : c*STRIDE + counts[c]]`` (ascending), else the chunk is unmoved.
    """
    total = 0
    sumsq = 0.0
    for c in prange(counts.size):
        cnt, ss = _scan_chunk(r, u, add, t, c, ent, old)
        counts[c] = cnt
        total += cnt
        sumsq += ss
    return total, sumsq


@njit(fastmath={"reassoc"}, nogil=True, cache=True)
def _scan_chunk(r, u, add, t, c, ent, old):  # pragma: no cover - compiled
    """The work of :func:`scan` for chunk ``c``: returns (qualifying elements, sum of squares).

    While the chunk records, each superblock goes through one of the superblock intrinsics:
    the branch-free one once the chunk has seen more than 1 hit per 64 elements, else the one
    that skips groups of 16 without a hit. A chunk whose count passes ``CAP`` (its records may
    run ``SUPER + W`` past it: the slack of ``STRIDE``) puts everything back and only counts.
    """
    n = r.size
    lo = c * CHUNK
    hi = min(lo + CHUNK, n)
    rs = r[lo:hi]
    us = u[lo:hi]
    base = c * STRIDE
    m = hi - lo
    cnt = 0
    rec = True
    ss = 0.0
    for b in range(m // SUPER):
        if rec:
            at = lo + b * SUPER
            every = cnt * 64 > b * SUPER
            if add and every:
                k, bs = _super_add_every(r, u, at, t, ent, old, base + cnt)
            elif add:
                k, bs = _super_add_sparse(r, u, at, t, ent, old, base + cnt)
            elif every:
                k, bs = _super_every(r, u, at, t, ent, old, base + cnt)
            else:
                k, bs = _super_sparse(r, u, at, t, ent, old, base + cnt)
            cnt += k
            ss += bs
            if cnt > CAP:
                _restore(r, ent, old, base, base + cnt)
                rec = False
            continue
        rb = rs[b * SUPER : (b + 1) * SUPER]
        ub = us[b * SUPER : (b + 1) * SUPER]
        hits = 0
        bs = t - t
        if add:
            for j in range(SUPER):
                v = rb[j] + ub[j]
                rb[j] = v
                hits += abs(v) >= t
                bs += v * v
        else:
            for j in range(SUPER):
                v = rb[j]
                hits += abs(v) >= t
                bs += v * v
        cnt += hits
        ss += bs
    tail = m - m % SUPER
    hits = 0
    for j in range(tail, m):
        if add:
            rs[j] = rs[j] + us[j]
        v = rs[j]
        ss += v * v
        hits += abs(v) >= t
    if hits and rec and cnt + hits > CAP:
        _restore(r, ent, old, base, base + cnt)
        rec = False
    if hits and rec:
        for j in range(tail, m):
            v = rs[j]
            if v >= t:
                ent[base + cnt] = lo + j + 1
                old[base + cnt] = v
                rs[j] = v - t
                cnt += 1
            elif v <= -t:
                ent[base + cnt] = -(lo + j + 1)
                old[base + cnt] = v
                rs[j] = v + t
                cnt += 1
    elif hits:
        cnt += hits
    return cnt, ss


@njit(**_OPTS)
def undo(r, counts, ent, old):  # pragma: no cover - compiled
    """Put back every element that :func:`scan` moved."""
    for c in prange(counts.size):
        if counts[c] <= CAP:
            _restore(r, ent, old, c * STRIDE, c * STRIDE + counts[c])


@njit(nogil=True, cache=True)
def _emit_prefix(counts, offsets, message, take, n, bits):  # pragma: no cover - compiled
    """Header of a sparse message; ``offsets[c]`` = qualifying elements before chunk ``c``."""
    acc = 0
    for c in range(counts.size):
        offsets[c] = acc
        acc += counts[c]
    message[0] = take
    message[1] = n
    message[2] = bits
    message[3] = 0


@njit(fastmath={"reassoc"}, nogil=True, cache=True)
def _emit_chunk(
    r, t, step, rewrite, counts, offsets, ent, old, take_all, entries, c
):  # pragma: no cover - compiled
    """The work of :func:`emit_sparse` for chunk ``c``: returns its change of ``sum(r*r)``."""
    cnt = counts[c]
    take = max(0, min(cnt, take_all - offsets[c]))
    d = 0.0
    if cnt <= CAP:
        base = c * STRIDE
        es = ent[base : base + take]
        os_ = old[base : base + take]
        out = entries[offsets[c] : offsets[c] + take]
        for k in range(take):
            out[k] = es[k]
        if rewrite:  # the scan moved by t: move by ``step`` instead, from the old values
            for k in range(take):
                v = os_[k]
                e = es[k]
                nv = v - step if e > 0 else v + step
                r[(e if e > 0 else -e) - 1] = nv
                d += nv * nv - v * v
        else:
            for k in range(take):
                v = os_[k]
                nv = v - t if es[k] > 0 else v + t
                d += nv * nv - v * v
        _restore(r, ent, old, base + take, base + cnt)
    elif take > 0:
        lo = c * CHUNK
        hi = min(lo + CHUNK, r.size)
        out = entries[offsets[c] : offsets[c] + take]
        k = 0
        g = lo
        while k < take and g < hi:
            v = r[g]
            if v >= t:
                out[k] = g + 1
                nv = v - step
                r[g] = nv
                d += nv * nv - v * v
                k += 1
            elif v <= -t:
                out[k] = -(g + 1)
                nv = v + step
                r[g] = nv
                d += nv * nv - v * v
                k += 1
            g += 1
    return d


@njit(fastmath={"reassoc"}, **_OPTS)
def emit_sparse(
    r, t, step, rewrite, counts, offsets, ent, old, take, message, bits
):  # pragma: no cover
    """Write the message of the first ``take`` entries after a :func:`scan`; undo the rest.

    ``message`` is the whole int32 message of ``take + 4`` words; ``bits`` the int32 reading
    of the float32 value it sends, for its header. Recorded chunks copy their entries and put
    back the moves past ``take`` (exactly, from the old values); an unmoved chunk rescans and
    moves its share. Each sent element moves by ``step``: t itself (``rewrite`` False: the
    scan's moves stay) or the mean magnitude (``rewrite``: each is rewritten from its old
    value). Returns the change of ``sum(r*r)`` caused by the moves that stay.
    """
    _emit_prefix(counts, offsets, message, take, r.size, bits)
    entries = message[4:]
    dsumsq = 0.0
    for c in prange(counts.size):
        dsumsq += _emit_chunk(r, t, step, rewrite, counts, offsets, ent, old, take, entries, c)
    return dsumsq


NBINS = 280
"""Bins of :func:`_bin_magnitude`: one per binary exponent of a float32 (frexp's -148..128)."""
_F32_MAX = np.finfo(np.float32).max


@njit(inline="always")
def _bin_magnitude(v, row):  # pragma: no cover - compiled
    """Add ``|v|`` (as a float32, inf clamped to the largest) into its exponent bin, exactly.

    A float32 magnitude is ``q * 2**(e - 24)`` with an integer ``q < 2**24`` (``frexp``), so
    ``row[e + 149] += q`` keeps the sum exact in int64 for up to 2**39 entries per bin, and in
    any order: the torch path bins the same way and gets the same sum.
    """
    a = np.float64(np.float32(min(abs(v), _F32_MAX)))
    mant, e = math.frexp(a)
    row[e + 149] += np.int64(mant * 16777216.0)


@njit(**_OPTS)
def sent_magnitudes(r, t, counts, old, take, bins):  # pragma: no cover - compiled
    """Bin the magnitudes of the first ``take`` entries found by the last :func:`scan`.

    Chunk ``c`` adds into ``bins[c]`` (zeroed by the caller): a recorded chunk from its old
    values, an unmoved one (``counts[c] > CAP``) by rescanning its still unmoved elements.
    """
    starts = np.empty(counts.size, np.int64)
    acc = 0
    for c in range(counts.size):
        starts[c] = acc
        acc += counts[c]
    for c in prange(counts.size):
        cnt = counts[c]
        mine = max(0, min(cnt, take - starts[c]))
        row = bins[c]
        if cnt <= CAP:
            base = c * STRIDE
            for k in range(base, base + mine):
                _bin_magnitude(old[k], row)
        elif mine > 0:
            lo = c * CHUNK
            hi = min(lo + CHUNK, r.size)
            k = 0
            g = lo
            while k < mine and g < hi:
                v = r[g]
                if abs(v) >= t:
                    _bin_magnitude(v, row)
                    k += 1
                g += 1


@njit(**_OPTS)
def bitmap_magnitudes(r, u, add, t, counts, pending, ent, old, bins):  # pragma: no cover
    """The first pass of a bitmap that sends the mean magnitude: put back the moves of the last
    :func:`scan` (with ``pending``), optionally ``r += u``, and bin ``|r|`` of every element
    with ``|r| >= t`` into ``bins[c]``. Returns the number of such elements."""
    n = r.size
    total = 0
    for c in prange(counts.size):
        if pending and counts[c] <= CAP:
            _restore(r, ent, old, c * STRIDE, c * STRIDE + counts[c])
        lo = c * CHUNK
        hi = min(lo + CHUNK, n)
        row = bins[c]
        hits = 0
        for g in range(lo, hi):
            if add:
                r[g] += u[g]
            v = r[g]
            if abs(v) >= t:
                _bin_magnitude(v, row)
                hits += 1
        total += hits
    return total


@njit(fastmath={"reassoc"}, **_OPTS)
def encode_bitmap_step(r, t, step, words):  # pragma: no cover - compiled
    """Bitmap-encode ``r`` in place, sending ``±step`` for every element with ``|r| >= t``.

    No half codes (a set sign bit without the magnitude bit would mean ``-step/2``). ``words``
    as in :func:`encode_bitmap`. Returns ``(elements sent, sum(r*r) after)``.
    """
    n = r.size
    sent = 0
    sumsq = 0.0
    zero = t - t
    for c in prange((n + CHUNK - 1) // CHUNK):
        lo = c * CHUNK
        hi = min(lo + CHUNK, n)
        cs = 0
        ss = 0.0
        for w in range(lo // 16, (hi + 15) // 16):
            acc = np.uint32(0)
            for j in range(min(16, hi - w * 16)):
                g = w * 16 + j
                v = r[g]
                mag = abs(v) >= t
                neg = mag & (v < zero)
                nv = v - ((-step if neg else step) if mag else zero)
                r[g] = nv
                ss += nv * nv
                cs += mag
                acc |= (np.uint32(mag) << np.uint32(j)) | (np.uint32(neg) << np.uint32(j + 16))
            words[w] = acc
        sent += cs
        sumsq += ss
    return sent, sumsq


@njit(inline="always")
def _bitmap_code(v, t, half, zero):  # pragma: no cover - compiled
    """(new value, magnitude bit, sign bit) of one element; bitwise ops keep it branch-free."""
    a = abs(v)
    mag = a >= t
    neg = v < zero
    sgn = neg & (a >= half)
    step = -t if neg else t
    hstep = -half if sgn else zero
    return v - (step if mag else hstep), mag, sgn


@njit(fastmath={"reassoc"}, **_OPTS)
def encode_bitmap(r, u, add, t, words, counts, pending, ent, old):  # pragma: no cover
    """Optionally ``r += u``; bitmap-encode ``r`` in place into ``words`` (uint32).

    ``words`` has N//16 + 1 entries with a zeroed last one. With ``pending`` the moves of the
    last :func:`scan` (described by ``counts``, ``ent``, ``old``) are put back chunk by chunk
    first. Returns ``(elements sent, sum(r*r) after)``.
    """
    sent = 0
    sumsq = 0.0
    for c in prange(counts.size):
        if pending and counts[c] <= CAP:
            _restore(r, ent, old, c * STRIDE, c * STRIDE + counts[c])
        cs, ss = _bitmap_chunk(r, u, add, t, c, words)
        counts[c] = cs
        sent += cs
        sumsq += ss
    return sent, sumsq


@njit(fastmath={"reassoc"}, nogil=True, cache=True)
def _bitmap_chunk(r, u, add, t, c, words):  # pragma: no cover - compiled
    """The work of :func:`encode_bitmap` for chunk ``c``: returns (sent, sum of squares)."""
    n = r.size
    half = t / 2
    zero = t - t
    lo = c * CHUNK
    hi = min(lo + CHUNK, n)
    m = hi - lo
    cs = 0
    ss = 0.0
    for b in range(m // SUPER):
        if add:
            k, bs = _bitmap_add(r, u, lo + b * SUPER, t, words)
        else:
            k, bs = _bitmap_in_place(r, u, lo + b * SUPER, t, words)
        cs += k
        ss += bs
    rs = r[lo:hi]
    us = u[lo:hi]
    ws = words[lo // 16 : (hi + 15) // 16]
    for w in range((m - m % SUPER) // 16, (m + 15) // 16):
        acc = np.uint32(0)
        for j in range(min(16, m - w * 16)):
            g = w * 16 + j
            v = rs[g] + us[g] if add else rs[g]
            nv, mag, sgn = _bitmap_code(v, t, half, zero)
            rs[g] = nv
            ss += nv * nv
            cs += mag | sgn
            acc |= (np.uint32(mag) << np.uint32(j)) | (np.uint32(sgn) << np.uint32(j + 16))
        ws[w] = acc
    return cs, ss


@njit(**_OPTS)
def first_bad_entry(entries, n, bad):  # pragma: no cover - compiled
    """Per chunk of entries, the first position that is 0, out of 1..n or not ascending, or -1."""
    k_all = entries.size
    for c in prange(bad.size):
        lo = c * CHUNK
        hi = min(lo + CHUNK, k_all)
        es = entries[lo:hi]
        prev = np.int64(0)
        if lo > 0:
            prev = abs(np.int64(entries[lo - 1]))
        found = -1
        nbad = 0
        # vectorised check first; the exact position only when something is wrong
        for k in range(hi - lo):
            a = abs(np.int64(es[k]))
            p = prev if k == 0 else abs(np.int64(es[k - 1]))
            nbad += (a == 0) or (a > n) or (a <= p)
        if nbad:
            p = prev
            for k in range(hi - lo):
                a = abs(np.int64(es[k]))
                if a == 0 or a > n or a <= p:
                    found = lo + k
                    break
                p = a
        bad[c] = found


@njit(**_OPTS)
def decode_sparse(entries, t, target):  # pragma: no cover - compiled
    """``target[|e|-1] += sign(e) * t`` for every (validated) entry."""
    for k in prange(entries.size):
        e = entries[k]
        if e > 0:
            target[e - 1] += t
        else:
            target[-e - 1] -= t


@njit(**_OPTS)
def decode_bitmap(words, t, target):  # pragma: no cover - compiled
    """Add the decoded bitmap into ``target`` (``words`` validated, uint32)."""
    n = target.size
    for c in prange((n + CHUNK - 1) // CHUNK):
        lo = c * CHUNK
        _bitmap_into(words[lo // 16 :], t, target[lo : min(lo + CHUNK, n)])


SMALL = 1 << 14
"""Sparse messages with fewer entries than this decode in one serial call (no thread launch)."""


@njit(nogil=True, cache=True)
def decode_small(words, target):  # pragma: no cover - compiled
    """Validate a whole small sparse message for ``target`` and only then add it, in one call.

    Returns 0 when decoded, 1 when the message is invalid (nothing written; the caller's full
    checks name the fault), 2 when it is not a sparse message of fewer than ``SMALL`` entries.
    t is widened to float64 and the sum rounded back: with 53 >= 2 * 24 + 2 bits that double
    rounding gives the float32 sum exactly.
    """
    n = target.size
    if words.size < 4 or words[3] != 0 or words.size - 4 >= SMALL:
        return 2
    if words[1] != n or words[0] != words.size - 4:
        return 1
    t = np.float64(words.view(np.float32)[2])
    if not (t > 0 and t < np.inf):
        return 1
    prev = np.int64(0)
    for k in range(4, words.size):
        a = abs(np.int64(words[k]))
        if a == 0 or a > n or a <= prev:
            return 1
        prev = a
    for k in range(4, words.size):
        e = words[k]
        if e > 0:
            target[e - 1] += t
        else:
            target[-e - 1] -= t
    return 0


@njit(nogil=True, cache=True)
def _lower_bound(entries, lo, hi, value):  # pragma: no cover - compiled
    """First position in ``entries[lo:hi]`` (ascending in ``|e|``) with ``|e| >= value``."""
    while lo < hi:
        mid = (lo + hi) // 2
        e = np.int64(entries[mid])
        if (e if e > 0 else -e) < value:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(inline="always")
def _range_in_chunk(flat, start, length, lo, hi):  # pragma: no cover - compiled
    """The entries of the sparse message at ``start`` that fall in elements ``lo..hi``."""
    first = start + 4
    end = start + length
    a = _lower_bound(flat, first, end, lo + 1)
    return a, _lower_bound(flat, a, end, hi + 1)


@njit(fastmath={"reassoc"}, **_OPTS)
def decode_sum(
    target, flat, starts, lengths, fmts, ts, divisor, exact_inverse, subtract, scratch
):  # pragma: no cover
    """Decode validated messages, in order, into a sum; overwrite or subtract it from ``target``.

    Message ``m`` is ``flat[starts[m] : starts[m] + lengths[m]]`` (format ``fmts[m]``,
    threshold ``ts[m]``). Per chunk of ``target``, while it is in cache: the sum starts at 0
    (in ``target`` itself, or in ``scratch`` with ``subtract``); every message adds its
    entries of the chunk (a binary search finds a sparse message's range). Then either
    ``target = sum / divisor`` or ``target -= sum / divisor``; with only sparse messages the
    subtraction touches just their entries and puts ``scratch`` back to zeros. Each element
    sees the operations of zero, decode each, divide, subtract, in that order: the results
    equal the unfused path bit for bit. With ``exact_inverse`` (a power of two) the division
    is a multiplication by ``1 / divisor``, which rounds the same.
    """
    n = target.size
    dense = False
    for m in range(fmts.size):
        dense |= fmts[m] != 0
    divide = divisor != 1
    zero = divisor - divisor
    inverse = 1 / divisor
    for c in prange((n + CHUNK - 1) // CHUNK):
        lo = c * CHUNK
        hi = min(lo + CHUNK, n)
        buf = scratch[lo:hi] if subtract else target[lo:hi]
        if not subtract:
            for j in range(hi - lo):
                buf[j] = zero
        for m in range(fmts.size):
            t = ts[m]
            if fmts[m] == 0:
                a, b = _range_in_chunk(flat, starts[m], lengths[m], lo, hi)
                for k in range(a, b):
                    e = flat[k]
                    if e > 0:
                        buf[e - 1 - lo] += t
                    else:
                        buf[-e - 1 - lo] -= t
            else:
                _bitmap_into(flat[starts[m] + 4 + lo // 16 : starts[m] + lengths[m]], t, buf)
        if not subtract:
            if divide and exact_inverse:
                for j in range(hi - lo):
                    buf[j] *= inverse
            elif divide:
                for j in range(hi - lo):
                    buf[j] /= divisor
            continue
        ps = target[lo:hi]
        if dense and divide and exact_inverse:
            for j in range(hi - lo):
                ps[j] -= buf[j] * inverse
                buf[j] = zero
        elif dense and divide:
            for j in range(hi - lo):
                ps[j] -= buf[j] / divisor
                buf[j] = zero
        elif dense:
            for j in range(hi - lo):
                ps[j] -= buf[j]
                buf[j] = zero
        else:
            for m in range(fmts.size):
                a, b = _range_in_chunk(flat, starts[m], lengths[m], lo, hi)
                for k in range(a, b):
                    e = flat[k]
                    i = (e if e > 0 else -e) - 1 - lo
                    ps[i] -= buf[i] / divisor if divide else buf[i]
                    buf[i] = zero


AHEAD = 32
"""Entries :func:`step_sum` fetches ahead of the one it steps."""


@njit(**_OPTS)
def step_sum(
    params, flat, starts, lengths, ts, divisor, exact_inverse, neg_lr, zero, bad
):  # pragma: no cover
    """Plain SGD with the mean of validated sparse messages as its gradient, touching only
    their elements: ``params[i] = fma(neg_lr, m_i, params[i])`` where ``m_i`` is
    :func:`decode_sum`'s element i (the messages' ``±ts[m]`` summed in order from zero, then
    divided by ``divisor``, or multiplied by its exact inverse), widened to the params' type
    by adding ``zero`` (-0.0, which keeps a -0.0). An element whose ``m_i`` is +0.0 (no
    message names it, or their entries cancel) keeps its value under such a step, and is
    left alone. ``bad[c]`` counts the non-finite values written in chunk ``c``.
    """
    n = params.size
    divide = divisor != 1
    inverse = (divisor / divisor) / divisor  # in the sum's type: the mean stays in it
    nothing = divisor - divisor
    for c in prange(bad.size):
        lo = c * CHUNK
        hi = min(lo + CHUNK, n)
        count = 0
        if ts.size == 1:  # one message: each entry is its element's whole sum
            a, b = _range_in_chunk(flat, starts[0], lengths[0], lo, hi)
            t = ts[0]
            for k in range(a, b):
                if k + AHEAD < b:  # the elements are far apart: fetch ahead of the steps
                    f = flat[k + AHEAD]
                    prefetch(params, (f if f > 0 else -f) - 1)
                e = flat[k]
                s = nothing + (t if e > 0 else -t)
                s = (s * inverse if exact_inverse else s / divisor) if divide else s
                i = (e if e > 0 else -e) - 1
                v = fma(neg_lr, s + zero, params[i])
                params[i] = v
                count += not (abs(v) < np.inf)
            bad[c] = count
            continue
        buf = np.empty(hi - lo, ts.dtype)  # the sums, at the messages' elements only
        first = np.empty(ts.size, np.int64)
        last = np.empty(ts.size, np.int64)
        for m in range(ts.size):
            first[m], last[m] = _range_in_chunk(flat, starts[m], lengths[m], lo, hi)
            for k in range(first[m], last[m]):
                e = flat[k]
                buf[(e if e > 0 else -e) - 1 - lo] = nothing
        for m in range(ts.size):
            t = ts[m]
            for k in range(first[m], last[m]):
                e = flat[k]
                buf[(e if e > 0 else -e) - 1 - lo] += t if e > 0 else -t
        for m in range(ts.size):
            for k in range(first[m], last[m]):
                e = flat[k]
                i = (e if e > 0 else -e) - 1
                s = buf[i - lo]
                s = (s * inverse if exact_inverse else s / divisor) if divide else s
                if s == 0 and math.copysign(1.0, s) > 0:
                    continue  # +0.0, or stepped already: the mark below
                v = fma(neg_lr, s + zero, params[i])
                params[i] = v
                count += not (abs(v) < np.inf)
                buf[i - lo] = nothing
        bad[c] = count


@njit(inline="always")
def _bitmap_into(words, t, buf):  # pragma: no cover - compiled
    """Add a chunk's bitmap ``words`` (int32, from the chunk's first word) into ``buf``."""
    half = t / 2
    zero = t - t
    m = buf.size
    for w in range((m + 15) // 16):
        width = min(16, m - w * 16)
        tb = buf[w * 16 : w * 16 + width]
        word = np.uint32(words[w])
        for j in range(width):
            mag = (word >> np.uint32(j)) & np.uint32(1)
            sgn = (word >> np.uint32(j + 16)) & np.uint32(1)
            step = -t if sgn else t
            hstep = -half if sgn else zero
            tb[j] += step if mag else hstep


COMPACT_SMALL = 1024
"""Gaps below this are counted by value when the compact form picks its r."""
DE_BRUIJN = 0x03F79D71B4CB0A89
"""(x & -x) · this, its top 6 bits, tell x's lowest set bit (:data:`LOWEST_BIT`); it is below
2^63, so the int64 product wraps as the uint64 one."""
LOWEST_BIT = np.zeros(64, np.int64)
for _bit in range(64):
    LOWEST_BIT[((DE_BRUIJN << _bit) % 2**64) >> 58] = _bit


@njit(nogil=True, cache=True)
def compact_r(entries):  # pragma: no cover - compiled
    """The least r of the fewest payload bytes for the ascending signed 1-based ``entries``,
    and those bytes. One pass counts each gap below :data:`COMPACT_SMALL` by value and sums
    the longer ones' high parts for every r; then each r's size is summed from the counts."""
    k = entries.size
    count = np.zeros(COMPACT_SMALL, np.int64)
    high = np.zeros(MAX_R + 1, np.int64)  # of the long gaps, then of all
    prev = np.int64(0)
    for j in range(k):
        a = abs(np.int64(entries[j]))
        x = a - prev - 1
        prev = a
        if x < COMPACT_SMALL:
            count[x] += 1
        else:
            for r in range(MAX_R + 1):
                high[r] += x >> r
    best_r, best = 0, np.int64(0)
    for r in range(MAX_R + 1):
        for x in range(1 << r, COMPACT_SMALL):  # x >> r is 0 below 2^r
            high[r] += count[x] * (x >> r)
        size = 1 + (k + 7) // 8 + (k * r + 7) // 8 + (high[r] + k + 7) // 8
        if r == 0 or size < best:
            best_r, best = r, size
        if high[r] == 0:
            break
    return best_r, best


@njit(nogil=True, cache=True)
def _lowest_bit(x):  # pragma: no cover - compiled
    """The index of the lowest set bit of int64 ``x`` > 0."""
    return LOWEST_BIT[(((x & -x) * DE_BRUIJN) >> 58) & 63]


@njit(nogil=True, cache=True)
def _fill(data, at, word, bits):  # pragma: no cover - compiled
    """A stream's read window: ``word`` with ``bits`` unread bits, topped up from ``data[at:]``
    a byte at a time to more than 48 bits (at most 56) or the end; the new word, at and bits."""
    while bits <= 48 and at < data.size:
        word |= np.int64(data[at]) << bits
        at += 1
        bits += 8
    return word, at, bits


@njit(nogil=True, cache=True)
def _store(payload, at, word, count):  # pragma: no cover - compiled
    """Store the low ``count`` bytes of ``word`` at ``payload[at:]``."""
    for i in range(count):
        payload[at + i] = (word >> (8 * i)) & 0xFF


@njit(nogil=True, cache=True)
def compact_entries(entries, payload, limit):  # pragma: no cover - compiled
    """Write the compact bytes of the ascending signed 1-based ``entries`` into the zeroed
    uint8 ``payload``; their count L, or -1 (nothing written) when L would pass ``limit``.
    Each stream's bits gather in a 64-bit word, stored 4 bytes at a time."""
    k = entries.size
    r, size = compact_r(entries)
    if size > limit:
        return -1
    payload[0] = r
    mask = (np.int64(1) << r) - 1
    low_at = 1 + (k + 7) // 8
    high_at = low_at + (k * r + 7) // 8
    signs = np.int64(0)
    low, low_bits = np.int64(0), 0
    high, high_bits = np.int64(0), 0
    prev = np.int64(0)
    for j in range(k):
        e = np.int64(entries[j])
        a = abs(e)
        x = a - prev - 1
        prev = a
        signs |= np.int64(e < 0) << (j & 7)
        if j & 7 == 7:
            payload[1 + (j >> 3)] = signs
            signs = 0
        low |= (x & mask) << low_bits
        low_bits += r
        if low_bits >= 32:
            _store(payload, low_at, low, 4)
            low >>= 32
            low_bits -= 32
            low_at += 4
        high_bits += x >> r  # q zeros, then a one
        while high_bits >= 32:
            _store(payload, high_at, high, 4)
            high >>= 32
            high_bits -= 32
            high_at += 4
        high |= np.int64(1) << high_bits
        high_bits += 1
    if k & 7:
        payload[1 + (k >> 3)] = signs
    _store(payload, low_at, low, (low_bits + 7) // 8)
    _store(payload, high_at, high, (high_bits + 7) // 8)
    return size


@njit(nogil=True, cache=True)
def expand_entries(data, out, numel):  # pragma: no cover - compiled
    """The signed 1-based entries of the compact bytes ``data`` into int32 ``out`` (K long):
    0, or 1 when the bytes are not a valid compact payload of K entries for ``numel``
    elements (the caller's torch path then names the fault). Every gap is at least 1, so the
    indices it accepts strictly ascend. The low and high streams are read through 64-bit
    windows of at most 56 bits."""
    k = out.size
    size = data.size
    if size == 0 or np.int64(data[0]) > MAX_R:
        return 1
    r = np.int64(data[0])
    mask = (np.int64(1) << r) - 1
    low_at = 1 + (k + 7) // 8
    high_at = low_at + (k * r + 7) // 8
    if high_at >= size or data[size - 1] == 0:
        return 1
    if k & 7 and (np.int64(data[low_at - 1]) >> (k & 7)) != 0:
        return 1
    if (k * r) & 7 and (np.int64(data[high_at - 1]) >> ((k * r) & 7)) != 0:
        return 1
    most = np.int64(numel) >> r
    low, low_bits = np.int64(0), 0
    high, high_bits = np.int64(0), 0
    signs = np.int64(0)
    pos = np.int64(0)
    for j in range(k):
        if j & 7 == 0:
            signs = np.int64(data[1 + (j >> 3)])
        if low_bits < r:
            low, low_at, low_bits = _fill(data, low_at, low, low_bits)
        v = low & mask
        low >>= r
        low_bits -= r
        q = np.int64(0)
        if high_bits <= 8:
            high, high_at, high_bits = _fill(data, high_at, high, high_bits)
        while high == 0:  # the window's bits are all zeros
            q += high_bits
            if high_at == size or q > most:
                return 1
            high, high_at, high_bits = _fill(data, high_at, high, 0)
        t = _lowest_bit(high)
        q += t
        high = (high >> t) >> 1
        high_bits -= t + 1
        if q > most:
            return 1
        pos += (q << r) + v + 1
        if pos > numel:
            return 1
        out[j] = -pos if signs & 1 else pos
        signs >>= 1
    if high != 0 or high_at != size:  # a one past the K-th, or bytes after its byte
        return 1
    return 0


def _serial_twin(kernel):  # pragma: no cover - runs at import of this module
    """The same kernel compiled without ``parallel`` (``prange`` runs as ``range``).

    For callers that are themselves one of several worker threads: no thread pool is woken,
    so nothing spins against the other workers, and no lock is needed.
    """
    fn = kernel.py_func
    twin = types_.FunctionType(
        fn.__code__, fn.__globals__, fn.__name__ + "_serial", fn.__defaults__, fn.__closure__
    )
    twin.__qualname__ = fn.__qualname__ + "_serial"  # its own numba cache files
    twin.__doc__ = fn.__doc__
    options = {k: v for k, v in kernel.targetoptions.items() if k not in ("parallel", "nopython")}
    return njit(cache=True, **options)(twin)


PARALLEL = {
    k.py_func.__name__: k
    for k in (
        count_nonfinite, take_update, decay_add, scan, undo, emit_sparse,
        encode_bitmap, first_bad_entry, decode_sparse, decode_bitmap, decode_sum, step_sum,
        sent_magnitudes, bitmap_magnitudes, encode_bitmap_step,
    )
}  # fmt: skip
"""The kernels that run chunks in parallel, by name."""
SERIAL = {name: _serial_twin(k) for name, k in PARALLEL.items()}
"""Their serial twins, by name."""
