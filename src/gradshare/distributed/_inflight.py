"""The tensors of gradshare's collectives, watched until the backend has let go of their work.

A collective's work, in the backend, holds the tensors it was given until the backend's own
thread drops it (gloo's worker, some time after the operation ends; NCCL's watchdog). Each
time that thread drops its reference to a tensor that Python also refers to, torch takes the
GIL to settle who owns the tensor's Python object. If the interpreter is finalising by then,
CPython ends the thread with ``pthread_exit``, whose unwinding through torch's noexcept
destructor aborts the process: "terminate called without an active exception", SIGABRT at
exit. A rank that leaves a moment after an exchange, on a loaded machine where the backend's
thread runs late, did exactly that. Keeping the tensors referenced does not help; only the
backend dropping the work while the interpreter is whole does.

The same late drop can deadlock a live process. ``destroy_process_group()``, or the last
reference to a group going away (a DDP model's reducer holds the world group), destroys the
backend while the GIL is held, and gloo's destructor joins its worker threads; a worker that
is just then dropping a work of Python-owned tensors waits for the GIL, and neither moves
again (seen as a rank that hangs right after a ``load_rank_state`` and a
``destroy_process_group``).

So every collective that gradshare issues goes through :func:`issue`, which notes each of its
tensors with its use count from before (``Tensor._use_count()``: the C++ references). The
work holds more; once a tensor is back at its count, no work holds it. A collective that
completed waits in :func:`settle` (the GIL released, microseconds as a rule) until the backend
has dropped it, so that none of gradshare's works outlives its call. :func:`drain`, at exit
while the interpreter is still whole, waits until every tensor is back, for the works whose
wait failed or timed out: the backend's threads have then dropped every work of ours, and
none of them takes the GIL during finalisation. Between exchanges the notes of finished works
are pruned, so they stay few.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

__all__ = ["drain", "issue", "settle", "watched"]

T = TypeVar("T")

_use_count: Callable[[torch.Tensor], int] | None = getattr(torch.Tensor, "_use_count", None)
"""A tensor's C++ references (torch without it: nothing is watched, nor waited for)."""
_lock = threading.Lock()
_watched: dict[int, tuple[torch.Tensor, int]] = {}
"""id → (tensor, its use count before its collective): a watched tensor's id is not reused."""


Tensors = Iterable[torch.Tensor | Iterable[torch.Tensor]]
"""The tensors of a collective's arguments: each a tensor or a list of tensors."""


def _flat(tensors: Tensors) -> list[torch.Tensor]:
    flat: list[torch.Tensor] = []
    for t in tensors:
        flat.extend([t] if isinstance(t, torch.Tensor) else t)
    return flat


def issue(start: Callable[[], T], tensors: Tensors) -> T:
    """Start a collective with ``start()`` and watch ``tensors`` (every tensor or list of
    tensors given to it) until its work is dropped; return the work."""
    if _use_count is None:
        return start()
    flat = _flat(tensors)
    before = [_use_count(t) for t in flat]
    work = start()
    with _lock:
        _prune()
        for t, count in zip(flat, before, strict=True):
            known = _watched.get(id(t))
            _watched[id(t)] = (t, count if known is None else min(count, known[1]))
    return work


def _prune() -> None:
    use_count = _use_count
    if use_count is None:
        return
    for key in [k for k, (t, count) in _watched.items() if use_count(t) <= count]:
        del _watched[key]


SETTLE_S = 5.0
"""How long :func:`settle` waits by default (microseconds as a rule; past this the caller goes
on, and the work is left to :func:`drain` at exit)."""


def settle(tensors: Tensors, timeout: float = SETTLE_S) -> bool:
    """Wait up to ``timeout`` seconds, the GIL released, until no work holds ``tensors`` (those
    of a completed collective whose work the caller no longer refers to); True if none does."""
    keys = {id(t) for t in _flat(tensors)}
    deadline = time.monotonic() + timeout
    while True:
        with _lock:
            _prune()
            if keys.isdisjoint(_watched):
                return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0001)


def drain(timeout: float) -> bool:
    """Wait up to ``timeout`` seconds, the GIL released, until the backend has dropped every
    work of ours; True if it has. (A collective still running, one whose wait timed out,
    ends at its group's own timeout, which gradshare's private groups set to its own.)"""
    deadline = time.monotonic() + timeout
    while True:
        with _lock:
            _prune()
            if not _watched:
                return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)


def watched() -> list[torch.Tensor]:
    """The tensors watched now (for tests)."""
    with _lock:
        return [t for t, _ in _watched.values()]
