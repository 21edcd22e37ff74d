"""The wire format: threshold encoding of a residual into int32 messages, and decoding back.

Byte-compatible with Deeplearning4j's ``EncodingHandler`` (docs/design.md §1). A message is a 1-D
little-endian ``int32`` tensor with a 4-word header ``[K or N, N, float32 bits of t, format]``
followed by either K signed 1-based indices (sparse, ``FLEXIBLE_ENCODING``) or ``N//16 + 1``
bitmap words (``BITMAP_ENCODING``, 2 bits per element).

Encoding works **in place** on the residual (only the encoded amount ``t`` leaves it; the
remainder stays, which is the error feedback of Strom 2015). With ``magnitude="mean"`` the
header's float is instead m, the mean magnitude of the sent elements (m >= t), and exactly
``±m`` leaves the residual per sent element: the format, and any DL4J decoder, are unchanged.
Decoding **adds** into its target and validates the whole message first: a bad message raises
:class:`MessageError` and leaves the target bit-for-bit untouched.

On CPU, float32 and float64 tensors go through fused numba kernels (:mod:`gradshare._kernels`,
compiled on first use and cached on disk); CUDA tensors, float16 and bfloat16 go through
vectorised torch ops with the same results.

Example::

    >>> import torch
    >>> from gradshare.codec import encode_sparse_, decode_
    >>> residual = torch.tensor([1.5, 2.5, -3.5])
    >>> encode_sparse_(residual, 0.5).tolist()
    [3, 3, 1056964608, 0, 1, 2, -3]
    >>> residual.tolist()
    [1.0, 2.0, -3.0]
"""

from __future__ import annotations

import contextlib
import math
import struct
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch

from gradshare import threads

__all__ = [
    "BITMAP_ENCODING",
    "FLEXIBLE_ENCODING",
    "HEADER_WORDS",
    "MAGNITUDES",
    "MAX_NUMEL",
    "MessageError",
    "MessageInfo",
    "bitmap_length",
    "check_message",
    "decode_",
    "decode_sum_",
    "encode_bitmap_",
    "encode_sparse_",
    "mean_magnitude",
    "message_info",
    "sparse_length",
    "subtract_sum_",
    "take_update_",
]

FLEXIBLE_ENCODING = 0
"""Format id of a sparse message (signed 1-based indices)."""
BITMAP_ENCODING = 1
"""Format id of a bitmap message (2 bits per element)."""
HEADER_WORDS = 4
MAX_NUMEL = 2**31 - 1
"""Largest N a message can address: indices are signed int32 ``±(i+1)``."""

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_KERNEL_DTYPES = (torch.float32, torch.float64)
_FORMAT_NAMES = {FLEXIBLE_ENCODING: "sparse", BITMAP_ENCODING: "bitmap"}
_F32 = struct.Struct("<f")
_I32 = struct.Struct("<i")
_NO_WORDS = np.zeros(0, np.int32)
_local = threading.local()
"""Per thread: the codec functions' workspace and the serial-kernels flag."""


class MessageError(ValueError):
    """A message that is not a valid gradshare/DL4J message for its target."""


@dataclass(frozen=True, slots=True)
class MessageInfo:
    """What a message's header (and, for a bitmap, its payload) says."""

    format: int
    """``FLEXIBLE_ENCODING`` or ``BITMAP_ENCODING``."""
    num_entries: int
    """Elements the message moves: K for sparse, set 2-bit codes for bitmap."""
    numel: int
    """N, the length of the vector it encodes."""
    threshold: float
    """The float32 stored in word 2: t, or the mean magnitude of a ``magnitude="mean"``
    message; each entry moves by it."""
    nbytes: int
    """Size on the wire."""

    @property
    def format_name(self) -> str:
        return _FORMAT_NAMES[self.format]


def sparse_length(num_entries: int) -> int:
    """Words in a sparse message of ``num_entries`` entries: K + 4."""
    return num_entries + HEADER_WORDS


def bitmap_length(numel: int) -> int:
    """Words in a bitmap message for N elements: N//16 + 5."""
    return numel // 16 + 1 + HEADER_WORDS


# --------------------------------------------------------------------------- checks


def check_vector(x: Any, name: str) -> None:
    """Raise unless ``x`` is a 1-D contiguous floating tensor that a message can address."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"Expect `{name}` to be a torch.Tensor, got {type(x).__name__}.")
    if x.dtype not in _FLOATS:
        raise TypeError(
            f"Expect `{name}` of dtype float16, bfloat16, float32 or float64, got {x.dtype}: "
            "messages carry real-valued updates; convert with `.float()`."
        )
    if x.dim() != 1:
        raise ValueError(
            f"Expect `{name}` to be 1-D, got shape {tuple(x.shape)}: flatten it with `.view(-1)`."
        )
    if not x.is_contiguous():
        raise ValueError(f"Expect `{name}` to be contiguous: call `.contiguous()` first.")
    if x.numel() > MAX_NUMEL:
        raise ValueError(
            f"Expect `{name}` to have fewer than 2**31 elements, got {x.numel()}: "
            "indices travel as signed int32; split the vector into several encoders."
        )


def _byte_span(x: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[lo, hi)`` that ``x``'s elements occupy (empty when it has none)."""
    numel = x.numel()
    if numel == 0:
        return 0, 0
    if x.is_contiguous():  # the common case, kept cheap: decode_ checks every message
        start = x.data_ptr()
        return start, start + numel * x.element_size()
    lo = hi = 0
    for size, stride in zip(x.shape, x.stride(), strict=True):
        reach = (size - 1) * stride
        lo, hi = lo + min(reach, 0), hi + max(reach, 0)
    size = x.element_size()
    start = x.data_ptr()
    return start + lo * size, start + (hi + 1) * size


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes of ``a``'s elements and ``b``'s overlap (same device only)."""
    if a.device != b.device:
        return False
    a_lo, a_hi = _byte_span(a)
    b_lo, b_hi = _byte_span(b)
    return a_lo < b_hi and b_lo < a_hi


def check_no_overlap(message: Any, target: torch.Tensor, what: str, name: str) -> None:
    """Raise MessageError if ``message`` (described by ``what``) lies in ``target``'s memory."""
    if isinstance(message, torch.Tensor) and shares_memory(message, target):
        raise MessageError(
            f"Expect {what} and `{name}` in separate memory, but they share bytes: decoding "
            f"writes `{name}` while it reads the message, so entries already checked would "
            "change under it. Clone the message first (`message.clone()`)."
        )


def float32_threshold(threshold: float) -> float:
    """Return ``threshold`` rounded to float32 (as the wire stores it), or raise ValueError."""
    try:
        t = _F32.unpack(_F32.pack(threshold))[0]
    except (OverflowError, TypeError, struct.error):
        t = math.inf
    if not (math.isfinite(t) and t > 0):
        raise ValueError(
            f"Expect `threshold` finite and > 0 in float32, got {threshold!r}: "
            "t is the step each sent entry moves by."
        )
    return t


def _threshold_bits(t: float) -> int:
    """The int32 reading of ``t``'s float32 bits (t already float32-representable)."""
    return int(_I32.unpack(_F32.pack(t))[0])


_SMALL = 1 << 14
"""Entries below which a kernel runs in the calling thread (``_kernels.SMALL``)."""


def _use_kernels(x: torch.Tensor) -> bool:
    return x.is_cpu and x.dtype in _KERNEL_DTYPES


_kernels_module: ModuleType | None = None
_kernel_lock = threading.Lock()
"""Serialises parallel kernel calls: each already uses every core, and not every numba
threading layer accepts launches from several threads at once."""


def _k() -> ModuleType:
    global _kernels_module
    if _kernels_module is None:
        from gradshare import _kernels

        _kernels_module = _kernels
    return _kernels_module


@contextlib.contextmanager
def serial_kernels() -> Iterator[None]:
    """Run this thread's kernel calls single-threaded while in the block.

    For code that is itself one of several worker threads (:class:`gradshare.ParallelWrapper`'s
    workers): the workers then encode and decode at the same time, each on its own core,
    instead of queueing for the kernels' thread pool, whose idle threads would spin against
    the other workers.
    """
    saved = getattr(_local, "serial", False)
    _local.serial = True
    try:
        yield
    finally:
        _local.serial = saved


def _launch(name: str, *args: Any, small: bool = False) -> Any:
    """Call kernel ``name``: its serial twin for ``small`` work, in a :func:`serial_kernels`
    block (waking the thread pool would cost more) or when this process's share of the machine
    is one thread (:func:`gradshare.threads.kernel_threads`), else the parallel one."""
    k = _k()
    if small or getattr(_local, "serial", False) or threads.kernel_threads() == 1:
        return k.SERIAL[name](*args)
    threads.parallel_threads()
    with _kernel_lock:
        return k.PARALLEL[name](*args)


def _scalar(t: float, x: torch.Tensor) -> Any:
    return np.float32(t) if x.dtype == torch.float32 else np.float64(t)


def find_nonfinite(x: torch.Tensor) -> tuple[int, int]:
    """Return (number of non-finite elements of a 1-D tensor, index of the first or -1)."""
    if _use_kernels(x):
        counts = np.zeros(_k().num_chunks(x.numel()), np.int64)
        _launch("count_nonfinite", x.detach().numpy(), counts)
        bad = int(counts.sum())
    else:
        bad = int((~torch.isfinite(x)).sum())
    return _first_nonfinite(x, bad)


def _first_nonfinite(x: torch.Tensor, bad: int) -> tuple[int, int]:
    if not bad:
        return 0, -1
    return bad, int(torch.nonzero(~torch.isfinite(x))[0, 0])


def nonfinite_error(x: torch.Tensor, bad: int, first: int, consequence: str) -> ValueError:
    """The error for an update ``x`` with ``bad`` non-finite values, the first at ``first``."""
    return ValueError(
        f"`update` has {bad} non-finite value(s), the first at flat index {first} "
        f"({float(x[first])}): {consequence}. Check the loss or lower the learning rate."
    )


def take_update_(
    before: torch.Tensor, after: torch.Tensor, out: torch.Tensor, *, restore: bool = False
) -> torch.Tensor:
    """``out = before - after``, the update an optimizer step made, checked to be finite.

    With ``restore`` the parameters ``after`` are also put back to ``before``. On CPU it is
    one pass over the three vectors (the check rides along, so the encoder need not read the
    update again: pass ``finite=True`` to :meth:`gradshare.Encoder.encode`).

    Raises:
        ValueError: the update has non-finite values (``out`` holds it; ``after`` is
            restored all the same when asked).
    """
    for name, x in (("before", before), ("after", after), ("out", out)):
        check_vector(x, name)
        if x.shape != before.shape or x.dtype != before.dtype or x.device != before.device:
            raise ValueError(
                f"Expect `{name}` like `before` ({before.dtype}, {tuple(before.shape)}, "
                f"{before.device}), got {x.dtype}, {tuple(x.shape)}, {x.device}."
            )
    if _use_kernels(before) and before.numel():
        counts = np.zeros(_k().num_chunks(before.numel()), np.int64)
        _launch("take_update", _array(before), _array(after), _array(out), restore, counts)
        bad = int(counts.sum())
    else:
        torch.sub(before, after, out=out)
        if restore:
            after.copy_(before)
        bad = int((~torch.isfinite(out)).sum())
    bad, first = _first_nonfinite(out, bad)
    if bad:
        raise nonfinite_error(out, bad, first, "nothing was shared")
    return out


# --------------------------------------------------------------------------- workspaces


class Workspace:
    """Reusable buffers of a two-step sparse encode: count first, then emit.

    ``scan_`` optionally adds an update into the residual and counts the elements that qualify
    (``|x| >= t``); ``emit_`` then writes the first ``limit`` of them into a message, or
    ``bitmap_`` encodes the residual as a bitmap instead. Logically nothing but the addition
    happens in ``scan_``, so a caller can still choose the format from the count.

    On the fused CPU path ``scan_`` works ahead: it already moves the qualifying elements while
    they are in cache and records their old values, and the next call on this workspace
    (``emit_``, ``bitmap_``, ``scan_`` or :meth:`settle_`) keeps or exactly undoes those moves;
    with fewer than 2 qualifying elements ``scan_`` undoes them itself. So between ``scan_`` and
    that next call the residual must not be read or written by anything else. One workspace
    serves one residual at a time; :class:`gradshare.Encoder` owns one, the plain codec
    functions keep one per thread.
    """

    def __init__(self) -> None:
        self.count = 0
        """Qualifying elements found by the last scan."""
        self.sumsq = 0.0
        """``sum(r*r)`` of the residual after the last scan, emit or bitmap."""
        self.value = 0.0
        """The float32 value each entry of the last emit or bitmap sends: t, or with
        ``mean=True`` the mean magnitude of the sent elements (:func:`mean_magnitude`)."""
        self._t = 0.0
        self._n = 0
        self._ts: Any = None
        """t as a numpy scalar of the residual's type, and its float32 bits (fused path)."""
        self._bits = 0
        self._capacity = 0
        self._idx: torch.Tensor | None = None
        self._counts = np.zeros(0, np.int64)
        self._offsets = np.zeros(0, np.int64)
        self._ent = np.zeros(0, np.int32)
        self._old: dict[Any, np.ndarray] = {}
        self._bins = np.zeros((0, 0), np.int64)
        self._fit: tuple[int, Any, int, np.ndarray, np.ndarray, np.ndarray] | None = None
        """(N, dtype, chunks, counts, offsets, old) of the last size served."""
        self._pending: tuple[torch.Tensor, np.ndarray] | None = None
        """(residual, its array) while the moves of the last scan are not settled."""

    def _reserve(self, n: int, dtype: Any) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        """(chunks, counts, offsets, old) for N elements of ``dtype``; grows the buffers."""
        fit = self._fit
        if fit is not None and fit[0] == n and fit[1] == dtype:
            return fit[2], fit[3], fit[4], fit[5]
        k = _k()
        nch = k.num_chunks(n)
        if nch > self._capacity:
            self._capacity = nch
            self._counts = np.zeros(nch, np.int64)
            self._offsets = np.zeros(nch, np.int64)
            self._ent = np.zeros(nch * k.STRIDE, np.int32)
            self._old = {}
        old = self._old.get(dtype)
        if old is None:
            old = self._old[dtype] = np.zeros(self._capacity * k.STRIDE, dtype)
        self._fit = (n, dtype, nch, self._counts[:nch], self._offsets[:nch], old)
        return self._fit[2:]

    def _scalar(self, t: float, dtype: Any) -> Any:
        """t as a numpy scalar of ``dtype`` (cached, with its header bits in ``_bits``)."""
        ts = self._ts
        if ts is None or type(ts) is not dtype.type or ts != t:
            ts = self._ts = dtype.type(t)
            self._bits = _threshold_bits(t)
        return ts

    def _zeroed_bins(self, chunks: int) -> np.ndarray:
        """Per-chunk exponent bins for :func:`mean_magnitude`, zeroed (grown as needed)."""
        if self._bins.shape[0] < chunks:
            self._bins = np.zeros((chunks, _k().NBINS), np.int64)
        bins = self._bins[:chunks]
        bins.fill(0)
        return bins

    def settle_(self) -> None:
        """Undo the moves a fused ``scan_`` made ahead, if no ``emit_``/``bitmap_`` followed."""
        if self._pending is not None:
            r = self._pending[1]
            self._pending = None
            _, counts, _, old = self._reserve(r.size, r.dtype)
            _launch("undo", r, counts, self._ent, old)

    def scan_(self, residual: torch.Tensor, update: torch.Tensor | None, t: float) -> int:
        """``residual += update`` (if given); count and remember the elements with ``|x| >= t``."""
        if self._pending is not None:
            self.settle_()
        n = residual.numel()
        if _use_kernels(residual):
            r = _array(residual)
            u = r if update is None else _array(update)
            _, counts, _, old = self._reserve(n, r.dtype)
            ts = self._scalar(t, r.dtype)
            self._t, self._n = t, n
            count, sumsq = _launch("scan", r, u, update is not None, ts, counts, self._ent, old)
            self.count, self.sumsq = count, sumsq
            if count >= 2:
                self._pending = (residual, r)
            elif count:
                self._pending = (residual, r)
                self.settle_()
            return count
        self._t, self._n = t, n
        if update is not None:
            residual.add_(update)
        x = residual.detach().float() if residual.dtype not in _KERNEL_DTYPES else residual.detach()
        self._idx = torch.nonzero(x.abs() >= t).view(-1)
        self.count = int(self._idx.numel())
        self.sumsq = float(x.double().square().sum())
        return self.count

    def _take_pending(self, residual: torch.Tensor) -> np.ndarray:
        """The array of ``residual`` with the moves of its last scan made (re-made if settled)."""
        pend = self._pending
        self._pending = None
        if pend is not None and _same(pend[0], residual):
            return pend[1]
        if pend is not None:
            self._pending = pend
            self.settle_()
        r = _array(residual)
        _, counts, _, old = self._reserve(r.size, r.dtype)
        ts = self._scalar(self._t, r.dtype)
        _launch("scan", r, r, False, ts, counts, self._ent, old)
        return r

    def emit_(
        self, residual: torch.Tensor, limit: int | None = None, *, mean: bool = False
    ) -> torch.Tensor:
        """Encode the first ``limit`` (default all) elements found by the last scan.

        Each sent element leaves the residual as ``±t``, or with ``mean`` as ``±m``, the mean
        magnitude of the sent elements (:func:`mean_magnitude`), which the header then carries.
        """
        t, n = self._t, self._n
        count = self.count
        take = count if limit is None or limit >= count else limit
        mean = mean and take > 0
        if _use_kernels(residual):
            message = torch.empty(take + HEADER_WORDS, dtype=torch.int32)
            r = self._take_pending(residual)
            nch, counts, offsets, old = self._reserve(n, r.dtype)
            ts = self._scalar(t, r.dtype)
            step, bits, self.value = ts, self._bits, t
            if mean:
                bins = self._zeroed_bins(nch)
                _launch("sent_magnitudes", r, ts, counts, old, take, bins, small=count < _SMALL)
                self.value = mean_magnitude(bins.sum(axis=0), take)
                step, bits = r.dtype.type(self.value), _threshold_bits(self.value)
            dsumsq = _launch(
                "emit_sparse",
                *(r, ts, step, mean, counts, offsets, self._ent, old, take),
                *(message.numpy(), bits),
                small=count < _SMALL,
            )
            self.sumsq += dsumsq
            return message
        message = torch.empty(take + HEADER_WORDS, dtype=torch.int32, device=residual.device)
        if self._pending is not None:
            self.settle_()
        assert self._idx is not None
        idx = self._idx[:take]
        x = residual[idx]
        xf = x.float() if x.dtype not in _KERNEL_DTYPES else x
        self.value = mean_magnitude(_torch_bins(xf), take) if mean else t
        _write_header(message, take, n, self.value, FLEXIBLE_ENCODING)
        pos = xf >= t
        moved = torch.where(pos, xf - self.value, xf + self.value)
        residual[idx] = moved.to(residual.dtype)
        message[HEADER_WORDS:] = torch.where(pos, idx + 1, -(idx + 1)).to(torch.int32)
        self.sumsq += float(moved.double().square().sum() - xf.double().square().sum())
        return message

    def bitmap_(
        self,
        residual: torch.Tensor,
        t: float,
        update: torch.Tensor | None = None,
        *,
        mean: bool = False,
    ) -> tuple[torch.Tensor, int]:
        """``residual += update`` (if given), bitmap-encode it in place; return message, sent.

        With ``mean`` every element with ``|x| >= t`` is sent as ``±m``, the mean of their
        magnitudes (:func:`mean_magnitude`), and no element as the half step ``-m/2``.
        """
        n = residual.numel()
        message = torch.empty(bitmap_length(n), dtype=torch.int32, device=residual.device)
        pend = self._pending
        pending = pend is not None and _same(pend[0], residual)
        if pend is not None and not (pending and _use_kernels(residual)):
            self.settle_()
            pending = False
        self._pending = None
        self.value = t
        if mean:
            return self._bitmap_mean(residual, t, update, message, pending)
        if _use_kernels(residual):
            r = _array(residual)
            u = r if update is None else _array(update)
            _, counts, _, old = self._reserve(n, r.dtype)
            ts = self._scalar(t, r.dtype)
            msg = message.numpy()
            msg[:HEADER_WORDS] = (n, n, self._bits, BITMAP_ENCODING)
            msg[-1] = 0
            sent, sumsq = _launch(
                "encode_bitmap",
                r,
                u,
                update is not None,
                ts,
                msg[HEADER_WORDS:].view(np.uint32),
                counts,
                pending,
                self._ent,
                old,
            )
            self.sumsq = sumsq
            return message, sent
        _write_header(message, n, n, t, BITMAP_ENCODING)
        if update is not None:
            residual.add_(update)
        payload, sent, sumsq = _torch_bitmap_(residual, t)
        message[HEADER_WORDS:] = payload
        self.sumsq = sumsq
        return message, sent

    def _bitmap_mean(
        self,
        residual: torch.Tensor,
        t: float,
        update: torch.Tensor | None,
        message: torch.Tensor,
        pending: bool,
    ) -> tuple[torch.Tensor, int]:
        """:meth:`bitmap_` with ``mean``: one pass to bin the magnitudes, one to encode."""
        n = residual.numel()
        if _use_kernels(residual):
            r = _array(residual)
            u = r if update is None else _array(update)
            nch, counts, _, old = self._reserve(n, r.dtype)
            bins = self._zeroed_bins(nch)
            ts = self._scalar(t, r.dtype)
            args = (r, u, update is not None, ts, counts, pending, self._ent, old, bins)
            hits = _launch("bitmap_magnitudes", *args)
            self.value = m = mean_magnitude(bins.sum(axis=0), hits) if hits else t
            msg = message.numpy()
            msg[:HEADER_WORDS] = (n, n, _threshold_bits(m), BITMAP_ENCODING)
            msg[-1] = 0
            step = r.dtype.type(m)
            words = msg[HEADER_WORDS:].view(np.uint32)
            sent, self.sumsq = _launch("encode_bitmap_step", r, ts, step, words)
            return message, sent
        if update is not None:
            residual.add_(update)
        x = residual.detach()
        x = x.float() if x.dtype not in _KERNEL_DTYPES else x
        mag = x.abs() >= t
        hits = int(mag.sum())
        self.value = m = mean_magnitude(_torch_bins(x[mag]), hits) if hits else t
        _write_header(message, n, n, m, BITMAP_ENCODING)
        step = torch.tensor(m, dtype=x.dtype, device=x.device)
        neg = mag & (x < 0)
        moved = x - torch.where(mag, torch.where(neg, -step, step), 0 * step)
        residual.copy_(moved)
        message[HEADER_WORDS:] = _pack_codes(mag, neg)
        self.sumsq = float(moved.double().square().sum())
        return message, hits


def _array(x: torch.Tensor) -> np.ndarray:
    """The numpy view of a CPU tensor (no copy)."""
    return (x.detach() if x.requires_grad else x).numpy()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (
        a.data_ptr() == b.data_ptr() and a.numel() == b.numel() and a.dtype == b.dtype
    )


def _write_header(message: torch.Tensor, first: int, numel: int, t: float, fmt: int) -> None:
    header = (first, numel, _threshold_bits(t), fmt)
    if message.device.type == "cpu":
        message.numpy()[:HEADER_WORDS] = header
    else:
        message[:HEADER_WORDS] = torch.tensor(header, dtype=torch.int32)


def _torch_bitmap_(residual: torch.Tensor, t: float) -> tuple[torch.Tensor, int, float]:
    x = residual.detach()
    x = x.float() if x.dtype not in _KERNEL_DTYPES else x
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
    sent = int((mag | hneg).sum())
    return _pack_codes(mag, sgn), sent, float(moved.double().square().sum())


def _pack_codes(mag: torch.Tensor, sgn: torch.Tensor) -> torch.Tensor:
    """The ``N//16 + 1`` int32 bitmap words of per-element magnitude and sign bits."""
    n = mag.numel()
    nwords = n // 16 + 1
    codes = torch.zeros(nwords * 16, dtype=torch.int64, device=mag.device)
    codes[:n] = mag.long() | (sgn.long() << 16)
    shifts = torch.arange(16, device=mag.device, dtype=torch.int64)
    words = (codes.view(nwords, 16) << shifts).sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


# --------------------------------------------------------------------------- mean magnitude

MAGNITUDES = ("threshold", "mean")
"""What a message's header float holds: t, or the mean magnitude of the sent elements."""
_NBINS = 280  # _kernels.NBINS, without importing numba


def check_magnitude(magnitude: Any) -> bool:
    """Return whether ``magnitude`` asks for the mean (``"mean"``), or raise ValueError."""
    if magnitude not in MAGNITUDES:
        raise ValueError(
            f"Expect `magnitude` to be 'threshold' or 'mean', got {magnitude!r}: the header's "
            "float is either t or the mean magnitude of the elements the message sends."
        )
    return bool(magnitude == "mean")


def mean_magnitude(bins: np.ndarray, count: int) -> float:
    """The float32 mean of ``count`` magnitudes given by their exponent ``bins``.

    Each magnitude ``|x|`` is taken as a float32 (inf and values past the float32 range as
    the largest float32); it equals ``q * 2**(e - 24)`` with ``(q, e) = frexp`` and
    ``bins[e + 149]`` holds the int64 sum of its ``q``. So the sum is exact, in any order and
    on any device; the mean is that sum divided by ``count``, rounded to float64 and then to
    float32. Every magnitude is >= t, and so is the mean.
    """
    total = 0
    for k in np.flatnonzero(bins).tolist():
        total += int(bins[k]) << k
    mean = total / (count << (149 + 24))  # exact int division, correctly rounded
    return float(_F32.unpack(_F32.pack(min(mean, _F32_MAX)))[0])


def _torch_bins(x: torch.Tensor) -> np.ndarray:
    """The exponent bins of ``|x|`` (see :func:`mean_magnitude`), on any device."""
    a = x.detach().abs().clamp(max=_F32_MAX).float()
    mant, exp = torch.frexp(a)
    q = (mant * 2.0**24).long()
    bins = torch.zeros(_NBINS, dtype=torch.int64, device=x.device)
    bins.index_add_(0, (exp + 149).long(), q)
    return bins.cpu().numpy()


def _workspace() -> Workspace:
    ws = getattr(_local, "workspace", None)
    if ws is None:
        ws = _local.workspace = Workspace()
    return ws


# --------------------------------------------------------------------------- encode


def check_boundary(boundary: int | None) -> None:
    if boundary is not None and (isinstance(boundary, bool) or not isinstance(boundary, int)):
        raise TypeError(f"Expect `boundary` to be an int or None, got {type(boundary).__name__}.")
    if boundary is not None and boundary < 1:
        raise ValueError(
            f"Expect `boundary` >= 1 or None, got {boundary}: it caps the entries of a message."
        )


def encode_sparse_(
    residual: torch.Tensor,
    threshold: float,
    boundary: int | None = None,
    *,
    magnitude: str = "threshold",
) -> torch.Tensor | None:
    """Sparse-encode ``residual`` in place; return the message, or None if fewer than 2 qualify.

    Every element with ``x >= t`` is sent as ``+(i+1)`` and moved by ``-t``; every element with
    ``x <= -t`` as ``-(i+1)`` and moved by ``+t``. With ``boundary`` B only the first B
    qualifying elements (ascending index) are sent and moved. When fewer than 2 elements qualify
    nothing is sent and ``residual`` is untouched (DL4J's rule).

    With ``magnitude="mean"`` the header carries m, the float32 mean of ``|x|`` over the sent
    elements (:func:`mean_magnitude`; m >= t), instead of t, and each sent element moves by m:
    a DL4J decoder adds ``±m`` per entry, exactly what left the residual.

    Args:
        residual: 1-D contiguous float tensor, changed in place.
        threshold: t > 0; rounded to float32 first, as the wire stores it.
        boundary: the most entries a message may carry, or None for no cap.
        magnitude: ``"threshold"`` (send t, DL4J's encoder) or ``"mean"`` (send m).

    Returns:
        An int32 message of ``K + 4`` words on ``residual``'s device, or None.
    """
    check_vector(residual, "residual")
    t = float32_threshold(threshold)
    check_boundary(boundary)
    mean = check_magnitude(magnitude)
    ws = _workspace()
    if ws.scan_(residual, None, t) < 2:
        return None
    return ws.emit_(residual, boundary, mean=mean)


def encode_bitmap_(
    residual: torch.Tensor, threshold: float, *, magnitude: str = "threshold"
) -> torch.Tensor:
    """Bitmap-encode ``residual`` in place and return the ``N//16 + 5``-word message.

    For each element v: if ``|v| >= t`` it is sent as ``±t`` and moved toward zero by t; else if
    ``v <= -t/2`` it is sent as ``-t/2`` and ``t/2`` is added; else nothing (positive values in
    ``[t/2, t)`` stay: DL4J's asymmetry, kept so that messages match bit for bit).

    With ``magnitude="mean"`` the elements with ``|v| >= t`` are sent as ``±m`` and moved by m,
    m being the float32 mean of their ``|v|`` (:func:`mean_magnitude`), which the header
    carries; no half steps are sent (they would mean ``-m/2``).
    """
    check_vector(residual, "residual")
    t = float32_threshold(threshold)
    mean = check_magnitude(magnitude)
    return _workspace().bitmap_(residual, t, mean=mean)[0]


# --------------------------------------------------------------------------- decode


def _check_message(message: Any) -> list[int]:
    """The header words of ``message`` after the basic checks of its type and shape."""
    if not isinstance(message, torch.Tensor):
        raise MessageError(f"Expect a message tensor, got {type(message).__name__}.")
    if message.dtype != torch.int32 or message.dim() != 1 or not message.is_contiguous():
        raise MessageError(
            "Expect a message to be a 1-D contiguous int32 tensor, got "
            f"dtype {message.dtype} and shape {tuple(message.shape)}."
        )
    if message.numel() < HEADER_WORDS:
        raise MessageError(
            f"Expect a message of at least {HEADER_WORDS} header words, got {message.numel()}."
        )
    if message.is_cpu:
        return message.numpy()[:HEADER_WORDS].tolist()
    return [int(v) for v in message[:HEADER_WORDS].tolist()]


def _parse_header(header: list[int], length: int) -> tuple[int, int, float]:
    """Return (format, entries-or-N, t) after checking the header against the length."""
    first, numel, bits, fmt = header
    if fmt not in _FORMAT_NAMES:
        raise MessageError(
            f"Unknown format id {fmt} in word 3: expect {FLEXIBLE_ENCODING} (sparse) "
            f"or {BITMAP_ENCODING} (bitmap)."
        )
    t = float(_F32.unpack(_I32.pack(bits))[0])
    if not (math.isfinite(t) and t > 0):
        raise MessageError(f"Expect a finite threshold > 0 in word 2, got {t!r} (bits {bits}).")
    if numel < 1:
        raise MessageError(f"Expect N >= 1 in word 1, got {numel}.")
    if fmt == FLEXIBLE_ENCODING:
        if first < 0 or sparse_length(first) != length:
            raise MessageError(
                f"Sparse header says K = {first} entries (K + 4 = {first + HEADER_WORDS} words),"
                f" but the message has {length} words."
            )
    else:
        if first != numel:
            raise MessageError(f"Bitmap header words 0 and 1 must both be N, got {first}, {numel}.")
        if bitmap_length(numel) != length:
            raise MessageError(
                f"Bitmap for N = {numel} has N//16 + 5 = {bitmap_length(numel)} words, "
                f"got {length}."
            )
    return fmt, first, t


def message_info(message: torch.Tensor) -> MessageInfo:
    """Read a message's header (and count a bitmap's entries) after checking it is well formed."""
    header = _check_message(message)
    fmt, first, t = _parse_header(header, message.numel())
    numel = header[1]
    if fmt == FLEXIBLE_ENCODING:
        entries = first
    else:
        words = message[HEADER_WORDS:].cpu().numpy().view(np.uint32)
        sent = (words | (words >> 16)) & 0xFFFF  # one bit per element that moves
        entries = int(np.bitwise_count(sent).sum())
    return MessageInfo(fmt, entries, numel, t, message.numel() * 4)


def _fault_text(entries: Any, k: int, numel: int) -> str:
    e = int(entries[k])
    if e == 0:
        return f"entry {k} is 0; entries are ±(i+1), never 0"
    if abs(e) > numel:
        return f"entry {k} is {e}, outside ±1..±{numel} (N = {numel})"
    return (
        f"entry {k} is {e} after {int(entries[k - 1])}: entries must be strictly ascending "
        "in |index|"
    )


def _first_bad_sparse(entries: torch.Tensor, numel: int) -> int:
    """Position of the first invalid sparse entry, or -1."""
    if entries.numel() == 0:
        return -1
    if entries.device.type == "cpu":
        bad = np.empty(_k().num_chunks(entries.numel()), np.int64)
        _launch("first_bad_entry", entries.numpy(), numel, bad, small=entries.numel() < _SMALL)
        hits = bad[bad >= 0]
        return int(hits[0]) if hits.size else -1
    a = entries.long().abs()
    prev = torch.cat([a.new_zeros(1), a[:-1]])
    faults = torch.nonzero((a == 0) | (a > numel) | (a <= prev))
    return int(faults[0, 0]) if faults.numel() else -1


def _check_bitmap_tail(words: torch.Tensor, numel: int) -> None:
    used = numel % 16
    last = int(words[-1]) & 0xFFFFFFFF
    allowed = ((1 << used) - 1) | (((1 << used) - 1) << 16)
    if last & ~allowed:
        raise MessageError(
            f"Bitmap word {HEADER_WORDS + numel // 16} sets bits for elements at or past N = "
            f"{numel}: only the low {used} magnitude and sign bits may be set."
        )


def check_message(message: torch.Tensor, numel: int) -> None:
    """Validate ``message`` whole for a vector of ``numel`` elements, writing nothing.

    Runs every check of the message itself that :func:`decode_` runs before it writes, so a
    message that passes here decodes without error into any vector of ``numel`` elements
    whose memory it does not share. Queues that hold messages for later (``IndexedTail``) call it on
    arrival, so that a bad message is refused at the door rather than half-applied later.

    Raises:
        MessageError: naming the first fault found.
    """
    _validate(message, numel)


def _validate(message: Any, numel: int) -> tuple[int, float]:
    """(format, t) of ``message`` after every check for a vector of ``numel`` elements."""
    header = _check_message(message)
    fmt, _, t = _parse_header(header, message.numel())
    if header[1] != numel:
        raise MessageError(
            f"Message encodes N = {header[1]} elements, but the vector has {numel}: "
            "it was made for another vector."
        )
    payload = message[HEADER_WORDS:]
    if fmt == FLEXIBLE_ENCODING:
        k = _first_bad_sparse(payload, numel)
        if k >= 0:
            raise MessageError("Invalid sparse message: " + _fault_text(payload, k, numel) + ".")
    else:
        _check_bitmap_tail(payload, numel)
    return fmt, t


def decode_(message: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Add the decoded ``message`` into ``target`` in place and return ``target``.

    The message is validated whole before any element is written: known format id, header
    consistent with the length, N equal to ``target``'s length, threshold finite and > 0, every
    sparse entry in ±1..±N, non-zero and strictly ascending, no bitmap bit past N. Any fault
    raises :class:`MessageError` naming it and ``target`` is left bit-for-bit unchanged. So is
    a message that shares bytes with ``target`` (a view of its memory): its writes would
    change the entries being read; clone such a message first.
    Decoding never zeroes ``target``: decoding a message twice adds it twice.
    """
    check_vector(target, "target")
    check_no_overlap(message, target, "the message", "target")
    if (
        type(message) is torch.Tensor
        and message.dtype == torch.int32
        and message.is_cpu
        and message.dim() == 1
        and message.is_contiguous()
        and _use_kernels(target)
        and _k().decode_small(message.numpy(), _array(target)) == 0
    ):  # a small sparse message, checked and added in one call
        return target
    if isinstance(message, torch.Tensor) and message.device != target.device:
        raise MessageError(
            f"Expect the message and `target` on one device, got {message.device} and "
            f"{target.device}: move the message with `.to(target.device)`."
        )
    fmt, t = _validate(message, target.numel())
    if fmt == FLEXIBLE_ENCODING:
        _apply_sparse(message[HEADER_WORDS:], t, target)
    else:
        _apply_bitmap(message[HEADER_WORDS:], t, target)
    return target


def decode_sum_(
    messages: Sequence[torch.Tensor | None],
    out: torch.Tensor,
    *,
    divisor: float = 1.0,
    names: Sequence[str] | None = None,
    checked: bool = False,
) -> torch.Tensor:
    """Overwrite ``out`` with the sum of the decoded ``messages`` divided by ``divisor``.

    The same result, bit for bit, as zeroing ``out``, decoding the messages into it in order
    (None entries are skipped) and dividing by ``divisor``; on CPU it is one pass over
    ``out``, each chunk zeroed, decoded into and divided while it is in cache. Every message
    is validated whole first: on a fault :class:`MessageError` names it (by ``names[i]``,
    e.g. ``"rank 2"``, default ``"position i"``) and ``out`` is untouched; so it is when a
    message shares bytes with ``out``.

    ``checked=True`` skips that validation and the check for shared memory (not the length
    check): only for messages that this process's own encoders made, in memory of their own,
    for a vector of this length; never for messages received from elsewhere.
    """
    return _sum_(messages, out, "out", None, divisor, names, checked)


def subtract_sum_(
    messages: Sequence[torch.Tensor | None],
    params: torch.Tensor,
    scratch: torch.Tensor,
    *,
    divisor: float = 1.0,
    names: Sequence[str] | None = None,
    checked: bool = False,
) -> torch.Tensor:
    """Step ``params -= (sum of the decoded messages) / divisor`` and return ``params``.

    The same result, bit for bit, as decoding the messages in order into a zeroed buffer,
    dividing it by ``divisor`` and subtracting it. ``scratch`` is a buffer like ``params``
    that holds zeros and is left holding zeros. On CPU, when every message is sparse, only
    the elements the messages name are touched, so a step costs O(entries), not O(N).
    Messages are validated whole first (unless ``checked``, as in :func:`decode_sum_`); on a
    fault ``params`` and ``scratch`` are untouched, and so they are when a message shares
    bytes with either or ``scratch`` with ``params``.
    """
    if scratch.shape != params.shape or scratch.dtype != params.dtype:
        raise ValueError(
            f"Expect `scratch` like `params` ({params.dtype}, {tuple(params.shape)}), got "
            f"{scratch.dtype}, {tuple(scratch.shape)}."
        )
    return _sum_(messages, params, "params", scratch, divisor, names, checked)


def _sum_(
    messages: Sequence[torch.Tensor | None],
    target: torch.Tensor,
    target_name: str,
    scratch: torch.Tensor | None,
    divisor: float,
    names: Sequence[str] | None,
    checked: bool,
) -> torch.Tensor:
    """Check everything, then decode ``messages`` into ``target`` (see the two callers)."""
    check_vector(target, target_name)
    _check_divisor(divisor)
    if names is not None and len(names) != len(messages):
        raise ValueError(
            f"Expect one name per message in `names`, got {len(names)} names for "
            f"{len(messages)} messages: a fault is reported by the name of its message."
        )
    if scratch is not None and shares_memory(scratch, target):
        raise ValueError(
            f"Expect `scratch` and `{target_name}` in separate memory, but they share bytes: "
            f"the sum is built in `scratch` while `{target_name}` is written. Pass a buffer of "
            f"its own, e.g. `torch.zeros_like({target_name})`."
        )
    numel = target.numel()
    present: list[tuple[torch.Tensor, int, float]] = []
    for i, m in enumerate(messages):
        if m is None:
            continue
        name = f"position {i}" if names is None else names[i]
        if checked:  # made here, in memory of its own, for a vector of this length: confirm N
            _, n, bits, fmt = m[:HEADER_WORDS].tolist()
            if n != numel:
                raise MessageError(
                    f"Message from {name} encodes N = {n} elements, but the target has "
                    f"{numel}: it was made for another vector."
                )
            present.append((m, fmt, float(_F32.unpack(_I32.pack(bits))[0])))
            continue
        check_no_overlap(m, target, f"the message from {name}", target_name)
        if scratch is not None:
            check_no_overlap(m, scratch, f"the message from {name}", "scratch")
        try:
            if isinstance(m, torch.Tensor) and m.device != target.device:
                raise MessageError(f"it is on {m.device}, the target on {target.device}")
            fmt, t = _validate(m, numel)
        except MessageError as e:
            raise MessageError(f"Message from {name} is invalid: {e}") from None
        present.append((m, fmt, t))
    if _use_kernels(target):
        lengths = np.array([m.numel() for m, _, _ in present], np.int64)
        starts = np.zeros(len(present), np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        if len(present) == 1:
            flat = present[0][0].numpy()
        else:
            flat = torch.cat([m for m, _, _ in present]).numpy() if present else _NO_WORDS
        dtype = _array(target).dtype
        ts = np.array([t for _, _, t in present], dtype)
        exact = math.frexp(divisor)[0] == 0.5  # a power of two: 1/divisor is exact
        if exact and (ts.size == 0 or ts.min() / divisor >= np.finfo(dtype).tiny):
            ts, divisor = ts / dtype.type(divisor), 1  # the same rounding, and no divide pass
        sparse = all(f == FLEXIBLE_ENCODING for _, f, _ in present)
        _launch(
            "decode_sum",
            _array(target),
            flat,
            starts,
            lengths,
            np.array([f for _, f, _ in present], np.int64),
            ts,
            dtype.type(divisor),
            exact,
            scratch is not None,
            _array(target if scratch is None else scratch),
            small=scratch is not None and sparse and flat.size < _SMALL,  # O(entries) work
        )
        return target
    buf = target if scratch is None else scratch
    if scratch is None:
        buf.zero_()
    for m, fmt, t in present:
        if fmt == FLEXIBLE_ENCODING:
            _apply_sparse(m[HEADER_WORDS:], t, buf)
        else:
            _apply_bitmap(m[HEADER_WORDS:], t, buf)
    if divisor != 1:
        buf.div_(divisor)
    if scratch is not None:
        target.sub_(buf)
        buf.zero_()
    return target


_F32_TINY = float(np.finfo(np.float32).tiny)
_F32_MAX = float(np.finfo(np.float32).max)


def _check_divisor(divisor: Any) -> None:
    """Raise ValueError unless ``divisor`` is a normal float32 > 0 (so is its reciprocal)."""
    if type(divisor) is int and 1 <= divisor <= 1 << 24:  # a count of parties or ranks
        return
    ok = isinstance(divisor, (int, float))
    if ok:
        try:
            d = _F32.unpack(_F32.pack(divisor))[0]
        except OverflowError:
            d = math.inf
        ok = _F32_TINY <= d <= _F32_MAX
    if not ok:
        raise ValueError(
            f"Expect `divisor` finite and > 0 as a normal float32 (between 1.2e-38 and "
            f"3.4e38), got {divisor!r}: the sum is divided by it in float32, where a smaller "
            "value rounds to 0 or has no finite reciprocal and a larger one rounds to inf."
        )


def _apply_sparse(entries: torch.Tensor, t: float, target: torch.Tensor) -> None:
    if entries.numel() == 0:
        return
    if _use_kernels(target):
        _launch("decode_sparse", entries.numpy(), _scalar(t, target), target.detach().numpy())
        return
    e = entries.long()
    idx = e.abs() - 1
    cur = target[idx]
    curf = cur.float() if cur.dtype not in _KERNEL_DTYPES else cur
    target[idx] = torch.where(e > 0, curf + t, curf - t).to(target.dtype)


def _apply_bitmap(words: torch.Tensor, t: float, target: torch.Tensor) -> None:
    if _use_kernels(target):
        _launch(
            "decode_bitmap",
            words.numpy().view(np.uint32),
            _scalar(t, target),
            target.detach().numpy(),
        )
        return
    n = target.numel()
    w = words.to(torch.int64) & 0xFFFFFFFF
    bits = (w.unsqueeze(1) >> torch.arange(32, device=w.device)) & 1
    mag = bits[:, :16].reshape(-1)[:n].bool()
    sgn = bits[:, 16:].reshape(-1)[:n].bool()
    cur = target.detach()
    curf = cur.float() if cur.dtype not in _KERNEL_DTYPES else cur
    step = torch.tensor(t, dtype=curf.dtype, device=curf.device)
    vals = torch.where(mag, torch.where(sgn, -step, step), torch.where(sgn, -step / 2, 0 * step))
    target.copy_((curf + vals).to(target.dtype))
