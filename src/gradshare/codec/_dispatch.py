"""Which path runs a codec step, and how a kernel is called (private).

A step runs as a fused numba kernel (:mod:`gradshare.codec._kernels`) when its tensor is on the CPU
in float32 or float64 and the kernels are on, else as vectorised torch ops
(:mod:`gradshare.codec._torch_paths`); both give the same results bit for bit.

The kernels are on unless the environment variable ``GRADSHARE_KERNELS`` is ``0`` when
gradshare is imported, or a :func:`use_kernels` block says otherwise. With them off nothing
imports numba. A kernel call runs on numba's thread pool, sized by :mod:`gradshare.codec.threads`,
or as its serial twin for small work, inside :func:`serial_kernels`, or when this process's
share of the machine is one thread.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

import numpy as np
import torch

from gradshare.codec import _torch_paths, threads
from gradshare.codec._format import DENSE_ENCODING, FLEXIBLE_ENCODING

ENV_VAR = "GRADSHARE_KERNELS"
"""The environment variable that turns the kernels off for the process (``0``)."""
KERNEL_DTYPES = (torch.float32, torch.float64)
SMALL = 1 << 14
"""Entries below which a kernel runs in the calling thread (``_kernels.SMALL``)."""
NO_WORDS = np.zeros(0, np.int32)


def _from_env() -> bool:
    raw = os.environ.get(ENV_VAR, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(
            f"Expect {ENV_VAR} to be 0 (torch ops only) or 1 (the default), got {raw!r}: "
            "unset it or fix it."
        )
    return raw != "0"


_enabled = _from_env()
"""Whether CPU float32/float64 steps run as kernels (read once from the environment)."""
_local = threading.local()
"""Per thread: the serial-kernels flag."""
_kernels_module: ModuleType | None = None
_kernel_lock = threading.Lock()
"""Serialises parallel kernel calls: each already uses every core, and not every numba
threading layer accepts launches from several threads at once."""


@contextlib.contextmanager
def use_kernels(enabled: bool) -> Iterator[None]:
    """Run the codec's CPU steps as fused kernels (``True``) or as torch ops while in the block.

    Process-wide, like ``GRADSHARE_KERNELS=0``: set it around work of this thread, not while
    other threads encode or decode (their step could start on one path and end on the other).
    Nested blocks restore the setting they found.
    """
    global _enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"Expect `enabled` to be a bool, got {type(enabled).__name__}.")
    saved = _enabled
    _enabled = enabled
    try:
        yield
    finally:
        _enabled = saved


def kernels_enabled() -> bool:
    """Whether the kernels are on (the environment, or the innermost :func:`use_kernels`)."""
    return _enabled


def on_kernels(x: torch.Tensor) -> bool:
    """Whether a step on ``x`` runs as a kernel."""
    return _enabled and x.is_cpu and x.dtype in KERNEL_DTYPES


def kernels() -> ModuleType:
    """:mod:`gradshare.codec._kernels`, imported (with numba) on first use."""
    global _kernels_module
    if _kernels_module is None:
        from gradshare.codec import _kernels

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


def launch(name: str, *args: Any, small: bool = False) -> Any:
    """Call kernel ``name``: its serial twin for ``small`` work, in a :func:`serial_kernels`
    block (waking the thread pool would cost more) or when this process's share of the machine
    is one thread (:func:`gradshare.codec.threads.kernel_threads`), else the parallel one."""
    k = kernels()
    if small or getattr(_local, "serial", False) or threads.kernel_threads() == 1:
        return k.SERIAL[name](*args)
    threads.parallel_threads()
    with _kernel_lock:
        return k.PARALLEL[name](*args)


def array(x: torch.Tensor) -> np.ndarray:
    """The numpy view of a CPU tensor (no copy)."""
    return (x.detach() if x.requires_grad else x).numpy()


def _maybe(x: torch.Tensor | None) -> np.ndarray | None:
    """The numpy view of a CPU tensor, or None (a kernel compiled without that array)."""
    return None if x is None else array(x)


def scalar(t: float, x: torch.Tensor) -> Any:
    """t as a numpy scalar of ``x``'s type."""
    return np.float32(t) if x.dtype == torch.float32 else np.float64(t)


# --------------------------------------------------------------------------- updates


def count_nonfinite(x: torch.Tensor) -> int:
    """The number of non-finite elements of a 1-D tensor."""
    if on_kernels(x):
        counts = np.zeros(kernels().num_chunks(x.numel()), np.int64)
        launch("count_nonfinite", x.detach().numpy(), counts)
        return int(counts.sum())
    return _torch_paths.count_nonfinite(x)


def take_update_(
    before: torch.Tensor, after: torch.Tensor, out: torch.Tensor, restore: bool,
    plus: torch.Tensor | None = None, source: torch.Tensor | None = None,
) -> int:  # fmt: skip
    """``out = (before + plus) - after`` (``before - after`` without ``plus``; then
    ``after = before`` with ``restore``, or ``after = source``); non-finite count of ``out``."""
    if restore:
        source = before
    if on_kernels(before) and before.numel():
        counts = np.zeros(kernels().num_chunks(before.numel()), np.int64)
        launch("take_update", array(before), _maybe(plus), array(after), array(out),
               _maybe(source), counts)  # fmt: skip
        return int(counts.sum())
    return _torch_paths.take_update_(before, after, out, plus, source)


def decay_add_(
    src: torch.Tensor, factor: float, dst: torch.Tensor, keep: torch.Tensor | None,
    before: torch.Tensor, after: torch.Tensor, plus: torch.Tensor | None,
    out: torch.Tensor | None, sample: tuple[torch.Tensor, int, int] | None = None,
    copy: torch.Tensor | None = None,
) -> int:  # fmt: skip
    """``keep = src`` and ``copy = after`` (if given), ``d = (before + plus) - after`` (into
    ``out`` if given) and ``dst = src * factor + d`` (``dst`` may be ``src``); ``sample = (m,
    start, stride)``: ``m[i] = |dst[start + i * stride]|``. The non-finite count of ``dst``."""
    if on_kernels(dst) and dst.numel():
        counts = np.zeros(kernels().num_chunks(dst.numel()), np.int64)
        d = array(dst)
        m, start, stride = (d[:0], 0, 1) if sample is None else (array(sample[0]), *sample[1:])
        launch("decay_add", array(src), scalar(factor, dst), d, _maybe(keep), array(before),
               _maybe(plus), array(after), _maybe(out), _maybe(copy), m, start, stride,
               counts)  # fmt: skip
        return int(counts.sum())
    return _torch_paths.decay_add_(src, factor, dst, keep, before, after, plus, out, sample, copy)


# --------------------------------------------------------------------------- decode


def first_bad_sparse(entries: torch.Tensor, numel: int) -> int:
    """Position of the first invalid sparse entry, or -1."""
    if entries.numel() == 0:
        return -1
    if _enabled and entries.device.type == "cpu":
        bad = np.empty(kernels().num_chunks(entries.numel()), np.int64)
        launch("first_bad_entry", entries.numpy(), numel, bad, small=entries.numel() < SMALL)
        hits = bad[bad >= 0]
        return int(hits[0]) if hits.size else -1
    return _torch_paths.first_bad_sparse(entries, numel)


def compact_entries(entries: torch.Tensor, payload: torch.Tensor, limit: int) -> int:
    """Write the compact bytes of sparse ``entries`` into the zeroed uint8 ``payload``; their
    count, or -1 when it would pass ``limit`` (nothing useful written)."""
    if _enabled and entries.is_cpu:
        return int(kernels().compact_entries(entries.numpy(), payload.numpy(), limit))
    return _torch_paths.compact_entries(entries, payload, limit)


def expand_entries(data: torch.Tensor, k: int, numel: int, out: torch.Tensor) -> str | None:
    """Write the K signed 1-based int32 entries that the compact bytes ``data`` hold into
    ``out``; None, or the fault (the torch path names it)."""
    if _enabled and data.is_cpu and kernels().expand_entries(data.numpy(), out.numpy(), numel) == 0:
        return None
    entries = _torch_paths.expand_entries(data, k, numel)
    if isinstance(entries, str):
        return entries
    out.copy_(entries)
    return None


def decode_small(message: Any, target: torch.Tensor) -> bool:
    """Check and add a small sparse ``message`` in one kernel call; whether it was added.

    False (nothing written) when it is no such message, or is invalid: the full checks then
    name the fault.
    """
    return (
        type(message) is torch.Tensor
        and message.dtype == torch.int32
        and message.is_cpu
        and message.dim() == 1
        and message.is_contiguous()
        and on_kernels(target)
        and kernels().decode_small(message.numpy(), array(target)) == 0
    )


def apply_sparse_(entries: torch.Tensor, t: float, target: torch.Tensor) -> None:
    """``target[|e|-1] += sign(e) * t`` for every (validated) entry."""
    if entries.numel() == 0:
        return
    if on_kernels(target):
        launch("decode_sparse", entries.numpy(), scalar(t, target), target.detach().numpy())
        return
    _torch_paths.apply_sparse_(entries, t, target)


def apply_bitmap_(words: torch.Tensor, t: float, target: torch.Tensor) -> None:
    """Add the decoded (validated) bitmap ``words`` into ``target``."""
    if on_kernels(target):
        launch(
            "decode_bitmap",
            words.numpy().view(np.uint32),
            scalar(t, target),
            target.detach().numpy(),
        )
        return
    _torch_paths.apply_bitmap_(words, t, target)


def _packed(
    present: Sequence[tuple[torch.Tensor, int, float]], dtype: Any, divisor: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, Any, bool]:
    """The messages back to back for a kernel: (words, starts, lengths, t of each in
    ``dtype``, the divisor in ``dtype``, whether it is a power of two). A power of two whose
    inverse scales every t without underflow is folded into the ts (the same rounding, and
    no divide pass): the divisor is then 1."""
    if len(present) == 1:
        m = present[0][0]
        flat, starts, lengths = m.numpy(), _ZERO_START, np.array([m.numel()], np.int64)
    else:
        lengths = np.array([m.numel() for m, _, _ in present], np.int64)
        starts = np.zeros(len(present), np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        flat = torch.cat([m for m, _, _ in present]).numpy() if present else NO_WORDS
    ts = np.array([t for _, _, t in present], dtype)
    exact = math.frexp(divisor)[0] == 0.5  # a power of two: 1/divisor is exact
    if exact and (ts.size == 0 or ts.min() / divisor >= _TINY[dtype.type]):
        ts, divisor = ts / dtype.type(divisor), 1
    return flat, starts, lengths, ts, dtype.type(divisor), exact


_ZERO_START = np.zeros(1, np.int64)
_TINY = {np.float32: np.finfo(np.float32).tiny, np.float64: np.finfo(np.float64).tiny}


def sum_(
    present: Sequence[tuple[torch.Tensor, int, float]],
    target: torch.Tensor,
    scratch: torch.Tensor | None,
    divisor: float,
) -> None:
    """Decode the validated ``(message, format, t)`` into ``target`` (overwritten by their sum
    divided by ``divisor``), or with ``scratch`` (zeros, left zeros) subtract that from it."""
    if not on_kernels(target) or any(f == DENSE_ENCODING for _, f, _ in present):
        _torch_paths.sum_(present, target, scratch, divisor)  # dense pieces: small vectors
        return
    t = array(target)
    flat, starts, lengths, ts, div, exact = _packed(present, t.dtype, divisor)
    sparse = all(f == FLEXIBLE_ENCODING for _, f, _ in present)
    fmts = np.array([f for _, f, _ in present], np.int64)
    launch(
        "decode_sum",
        t,
        flat,
        starts,
        lengths,
        fmts,
        ts,
        div,
        exact,
        scratch is not None,
        t if scratch is None else array(scratch),
        small=scratch is not None and sparse and flat.size < SMALL,
    )  # O(entries) work


def step_sum_(
    present: Sequence[tuple[torch.Tensor, int, float]],
    params: torch.Tensor,
    scratch: torch.Tensor,
    lr: float,
    divisor: float,
) -> int:
    """Plain SGD, ``params.add_(m, alpha=-lr)``, with ``m`` the validated ``(message, format,
    t)`` decoded and summed into ``scratch``'s type and divided by ``divisor``
    (:func:`sum_`'s result); the non-finite count of the elements it changed. On the kernels
    with only sparse messages it touches just their elements and leaves ``scratch`` alone;
    else ``scratch`` holds ``m`` after."""
    sparse = all(f == FLEXIBLE_ENCODING for _, f, _ in present)
    if not (on_kernels(params) and on_kernels(scratch) and sparse):
        sum_(present, scratch, None, divisor)
        params.add_(scratch.to(params.dtype), alpha=-lr)
        return count_nonfinite(params)
    if not present or params.numel() == 0:
        return 0
    p = array(params)
    flat, starts, lengths, ts, div, exact = _packed(present, array(scratch).dtype, divisor)
    bad = np.zeros(kernels().num_chunks(params.numel()), np.int64)
    launch(
        "step_sum",
        p,
        flat,
        starts,
        lengths,
        ts,
        div,
        exact,
        p.dtype.type(-lr),
        p.dtype.type(-0.0),
        bad,
        small=flat.size < SMALL,
    )  # O(entries) work
    return int(bad.sum())
