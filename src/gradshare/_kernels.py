"""Fused CPU kernels behind :mod:`gradshare.codec` (private).

Every kernel works on a flat float32 or float64 array split into chunks of :data:`CHUNK`
elements; chunks run in parallel (``prange``) and each chunk walks its elements in blocks of
:data:`SUPER` or 16 so that the inner loops are indexed from 0 and vectorise.

Sparse encoding is two passes, so that the format can be chosen before anything is changed:

1. :func:`scan` adds the update into the residual (optional), counts the elements with
   ``|x| >= t`` per chunk, remembers their chunk-local positions as *candidates* (up to ``cap``
   per chunk) while the block is still in cache, and sums ``x*x`` for the residual norm.
2. :func:`emit_sparse` writes the chosen entries into the message and moves only those elements
   by ``t``; it touches K elements, not N (a chunk whose candidates overflowed is rescanned).

This module imports numba; :mod:`gradshare.codec` imports it on first use only, and numba compiles
each kernel on its first call (cached on disk), so importing gradshare compiles nothing.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

CHUNK = 1 << 16
"""Elements per parallel chunk (a multiple of 16, so bitmap words never straddle chunks)."""
SUPER = 256
"""Elements per vectorised superblock inside a chunk."""
CAP = CHUNK // 16
"""Candidates remembered per chunk; a chunk with more is rescanned by :func:`emit_sparse`."""

_OPTS = {"parallel": True, "nogil": True, "cache": True}


def num_chunks(n: int) -> int:
    return (n + CHUNK - 1) // CHUNK


@njit(**_OPTS)
def count_nonfinite(x, counts):  # pragma: no cover - compiled
    """Count the non-finite elements of ``x`` per chunk into ``counts``."""
    n = x.size
    for c in prange(counts.size):
        lo = c * CHUNK
        hi = min(lo + CHUNK, n)
        xs = x[lo:hi]
        bad = 0
        for j in range(hi - lo):
            bad += not (abs(xs[j]) < np.inf)
        counts[c] = bad


_DEBRUIJN = np.array(
    [
        0,
        1,
        28,
        2,
        29,
        14,
        24,
        3,
        30,
        22,
        20,
        15,
        25,
        17,
        4,
        8,
        31,
        27,
        13,
        23,
        21,
        19,
        16,
        7,
        26,
        12,
        18,
        6,
        11,
        5,
        10,
        9,
    ],
    np.int64,
)
"""Bit position of a power of two from its de Bruijn product (count trailing zeros)."""


@njit(fastmath={"reassoc"}, **_OPTS)
def scan(r, u, add, t, counts, sumsq, cand):  # pragma: no cover - compiled
    """Optionally ``r += u``; count ``|r| >= t`` per chunk, keep candidates, sum ``r*r``.

    Each chunk walks superblocks of 256 elements with one vectorised loop (add, count, square);
    only a superblock with hits is looked at again, 16 elements at a time, as a 16-bit mask whose
    set bits are the candidates. ``cand`` holds ``CAP`` chunk-local positions per chunk;
    ``counts[c]`` may exceed ``CAP`` (then :func:`emit_sparse` rescans that chunk).
    """
    n = r.size
    db = _DEBRUIJN
    for c in prange(counts.size):
        lo = c * CHUNK
        hi = min(lo + CHUNK, n)
        rs = r[lo:hi]
        us = u[lo:hi]
        cs = cand[c * CAP : (c + 1) * CAP]
        m = hi - lo
        cnt = 0
        ss = 0.0
        for b in range(m // SUPER):
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
            ss += bs
            if hits:
                for q in range(SUPER // 16):
                    qb = rb[q * 16 : (q + 1) * 16]
                    mask = np.uint32(0)
                    for j in range(16):
                        mask |= np.uint32(abs(qb[j]) >= t) << np.uint32(j)
                    while mask:
                        low = mask & (~mask + np.uint32(1))
                        j = db[((low * np.uint32(0x077CB531)) & np.uint32(0xFFFFFFFF)) >> 27]
                        if cnt < CAP:
                            cs[cnt] = b * SUPER + q * 16 + j
                        cnt += 1
                        mask ^= low
        for k in range(m - m % SUPER, m):
            if add:
                rs[k] = rs[k] + us[k]
            v = rs[k]
            ss += v * v
            if abs(v) >= t:
                if cnt < CAP:
                    cs[cnt] = k
                cnt += 1
        counts[c] = cnt
        sumsq[c] = ss


@njit(**_OPTS)
def emit_sparse(r, t, counts, offsets, cand, limit, entries, dsumsq):  # pragma: no cover
    """Write up to ``limit`` entries in index order and move those elements by ``t``.

    ``offsets[c]`` is the number of qualifying elements before chunk ``c``. ``dsumsq[c]``
    receives the change of ``sum(r*r)`` caused by the chunk's moves.
    """
    n = r.size
    for c in prange(counts.size):
        take = min(counts[c], limit - offsets[c])
        if take <= 0:
            dsumsq[c] = 0.0
            continue
        lo = c * CHUNK
        hi = min(lo + CHUNK, n)
        out = entries[offsets[c] : offsets[c] + take]
        d = 0.0
        if counts[c] <= CAP:
            cs = cand[c * CAP : c * CAP + take]
            for k in range(take):
                g = lo + cs[k]
                v = r[g]
                if v >= t:
                    out[k] = g + 1
                    nv = v - t
                else:
                    out[k] = -(g + 1)
                    nv = v + t
                r[g] = nv
                d += nv * nv - v * v
        else:
            k = 0
            g = lo
            while k < take and g < hi:
                v = r[g]
                if v >= t:
                    out[k] = g + 1
                    nv = v - t
                    r[g] = nv
                    d += nv * nv - v * v
                    k += 1
                elif v <= -t:
                    out[k] = -(g + 1)
                    nv = v + t
                    r[g] = nv
                    d += nv * nv - v * v
                    k += 1
                g += 1
        dsumsq[c] = d


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
def encode_bitmap(r, u, add, t, words, counts, sumsq):  # pragma: no cover - compiled
    """Optionally ``r += u``; bitmap-encode ``r`` in place into ``words`` (uint32).

    ``words`` has N//16 + 1 entries with a zeroed last one; ``counts[c]`` receives the number of
    elements sent, ``sumsq[c]`` the new ``sum(r*r)``.
    """
    n = r.size
    half = t / 2
    zero = t - t
    for c in prange(counts.size):
        lo = c * CHUNK
        hi = min(lo + CHUNK, n)
        rs = r[lo:hi]
        us = u[lo:hi]
        ws = words[lo // 16 : (hi + 15) // 16]
        m = hi - lo
        sent = 0
        ss = 0.0
        for w in range((m + 15) // 16):
            width = min(16, m - w * 16)
            rb = rs[w * 16 : w * 16 + width]
            ub = us[w * 16 : w * 16 + width]
            acc = np.uint32(0)
            bs = zero
            for j in range(width):
                v = rb[j] + ub[j] if add else rb[j]
                nv, mag, sgn = _bitmap_code(v, t, half, zero)
                rb[j] = nv
                bs += nv * nv
                sent += mag | sgn
                acc |= (np.uint32(mag) << np.uint32(j)) | (np.uint32(sgn) << np.uint32(j + 16))
            ws[w] = acc
            ss += bs
        counts[c] = sent
        sumsq[c] = ss


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
    half = t / 2
    zero = t - t
    for c in prange((n + CHUNK - 1) // CHUNK):
        lo = c * CHUNK
        hi = min(lo + CHUNK, n)
        ts = target[lo:hi]
        ws = words[lo // 16 : (hi + 15) // 16]
        m = hi - lo
        for w in range((m + 15) // 16):
            width = min(16, m - w * 16)
            tb = ts[w * 16 : w * 16 + width]
            word = ws[w]
            for j in range(width):
                mag = (word >> np.uint32(j)) & np.uint32(1)
                sgn = (word >> np.uint32(j + 16)) & np.uint32(1)
                step = -t if sgn else t
                hstep = -half if sgn else zero
                tb[j] += step if mag else hstep


SMALL = 1 << 14
"""Sparse messages with fewer entries than this decode in one serial call (no thread launch)."""


@njit(nogil=True, cache=True)
def decode_sparse_small(entries, n, t, target):  # pragma: no cover - compiled
    """Validate every entry, then (only if all are valid) add them; return the first bad or -1."""
    prev = np.int64(0)
    for k in range(entries.size):
        a = abs(np.int64(entries[k]))
        if a == 0 or a > n or a <= prev:
            return k
        prev = a
    for k in range(entries.size):
        e = entries[k]
        if e > 0:
            target[e - 1] += t
        else:
            target[-e - 1] -= t
    return -1
