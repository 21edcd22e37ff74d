"""The encode workspace (private): reusable buffers of a two-step encode, count then emit.

:class:`Workspace` is the one implementation behind :func:`gradshare.codec.encode_sparse_`,
:func:`gradshare.codec.encode_bitmap_` and :class:`gradshare.Encoder`; each of its steps runs
as fused kernels (through :mod:`gradshare.codec._dispatch`) or as torch ops
(:mod:`gradshare.codec._torch_paths`).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from gradshare.codec import _torch_paths
from gradshare.codec._dispatch import SMALL, array, kernels, launch, on_kernels
from gradshare.codec._format import (
    BITMAP_ENCODING,
    HEADER_WORDS,
    bitmap_length,
    mean_magnitude,
    threshold_bits,
)

_local = threading.local()
"""Per thread: the workspace of the plain codec functions."""


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
        k = kernels()
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
            self._bits = threshold_bits(t)
        return ts

    def _zeroed_bins(self, chunks: int) -> np.ndarray:
        """Per-chunk exponent bins for :func:`mean_magnitude`, zeroed (grown as needed)."""
        if self._bins.shape[0] < chunks:
            self._bins = np.zeros((chunks, kernels().NBINS), np.int64)
        bins = self._bins[:chunks]
        bins.fill(0)
        return bins

    def settle_(self) -> None:
        """Undo the moves a fused ``scan_`` made ahead, if no ``emit_``/``bitmap_`` followed."""
        if self._pending is not None:
            r = self._pending[1]
            self._pending = None
            _, counts, _, old = self._reserve(r.size, r.dtype)
            launch("undo", r, counts, self._ent, old)

    def drop_(self) -> None:
        """Forget the moves a fused ``scan_`` made ahead, without undoing them: the caller
        has put its residual back whole (from a copy of its own) or given it up."""
        self._pending = None

    def scan_(self, residual: torch.Tensor, update: torch.Tensor | None, t: float) -> int:
        """``residual += update`` (if given); count and remember the elements with ``|x| >= t``."""
        if self._pending is not None:
            self.settle_()
        n = residual.numel()
        if on_kernels(residual):
            r = array(residual)
            u = r if update is None else array(update)
            _, counts, _, old = self._reserve(n, r.dtype)
            ts = self._scalar(t, r.dtype)
            self._t, self._n = t, n
            count, sumsq = launch("scan", r, u, update is not None, ts, counts, self._ent, old)
            self.count, self.sumsq = count, sumsq
            if count >= 2:
                self._pending = (residual, r)
            elif count:
                self._pending = (residual, r)
                self.settle_()
            return count
        self._t, self._n = t, n
        self._idx, self.sumsq = _torch_paths.scan_(residual, update, t)
        self.count = int(self._idx.numel())
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
        r = array(residual)
        _, counts, _, old = self._reserve(r.size, r.dtype)
        ts = self._scalar(self._t, r.dtype)
        launch("scan", r, r, False, ts, counts, self._ent, old)
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
        if on_kernels(residual):
            message = torch.empty(take + HEADER_WORDS, dtype=torch.int32)
            r = self._take_pending(residual)
            nch, counts, offsets, old = self._reserve(n, r.dtype)
            ts = self._scalar(t, r.dtype)
            step, bits, self.value = ts, self._bits, t
            if mean:
                bins = self._zeroed_bins(nch)
                launch("sent_magnitudes", r, ts, counts, old, take, bins, small=count < SMALL)
                self.value = mean_magnitude(bins.sum(axis=0), take)
                step, bits = r.dtype.type(self.value), threshold_bits(self.value)
            dsumsq = launch(
                "emit_sparse",
                *(r, ts, step, mean, counts, offsets, self._ent, old, take),
                *(message.numpy(), bits),
                small=count < SMALL,
            )
            self.sumsq += dsumsq
            return message
        if self._pending is not None:
            self.settle_()
        assert self._idx is not None
        message, self.value, dsumsq = _torch_paths.emit_(residual, self._idx, take, t, mean)
        self.sumsq += dsumsq
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
        if pend is not None and not (pending and on_kernels(residual)):
            self.settle_()
            pending = False
        self._pending = None
        self.value = t
        if mean:
            return self._bitmap_mean(residual, t, update, message, pending)
        if on_kernels(residual):
            r = array(residual)
            u = r if update is None else array(update)
            _, counts, _, old = self._reserve(n, r.dtype)
            ts = self._scalar(t, r.dtype)
            msg = message.numpy()
            msg[:HEADER_WORDS] = (n, n, self._bits, BITMAP_ENCODING)
            msg[-1] = 0
            sent, sumsq = launch(
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
        sent, self.sumsq = _torch_paths.bitmap_(residual, t, update, message)
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
        if on_kernels(residual):
            r = array(residual)
            u = r if update is None else array(update)
            nch, counts, _, old = self._reserve(n, r.dtype)
            bins = self._zeroed_bins(nch)
            ts = self._scalar(t, r.dtype)
            args = (r, u, update is not None, ts, counts, pending, self._ent, old, bins)
            hits = launch("bitmap_magnitudes", *args)
            self.value = m = mean_magnitude(bins.sum(axis=0), hits) if hits else t
            msg = message.numpy()
            msg[:HEADER_WORDS] = (n, n, threshold_bits(m), BITMAP_ENCODING)
            msg[-1] = 0
            step = r.dtype.type(m)
            words = msg[HEADER_WORDS:].view(np.uint32)
            sent, self.sumsq = launch("encode_bitmap_step", r, ts, step, words)
            return message, sent
        hits, self.value, self.sumsq = _torch_paths.bitmap_mean_(residual, t, update, message)
        return message, hits


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (
        a.data_ptr() == b.data_ptr() and a.numel() == b.numel() and a.dtype == b.dtype
    )


def thread_workspace() -> Workspace:
    """The workspace of the plain codec functions in this thread."""
    ws = getattr(_local, "workspace", None)
    if ws is None:
        ws = _local.workspace = Workspace()
    return ws
