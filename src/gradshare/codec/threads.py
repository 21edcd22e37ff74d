"""How many threads gradshare's CPU kernels use: this process's share of the machine.

Every rank of a job runs its own kernels. Left alone, numba would start a pool of all the
machine's cores in every rank (two ranks on two cores: four spinning threads), and its OpenMP
layer would also raise the thread count that torch reads from the shared OpenMP runtime. So by
default a process's kernels use its share:

    share = min(torch.get_num_threads(), usable CPUs // ranks on this host)

where torch's count already reflects ``OMP_NUM_THREADS`` (torchrun sets 1 for several
processes), usable CPUs are the process's CPU affinity, and the ranks on this host come from
``LOCAL_WORLD_SIZE`` (torchrun) or, for ranks started another way (``torch.multiprocessing``),
from the process group: :class:`~gradshare.SharedOptimizer` and the DDP hook count the ranks
that share this host once, when they start
(:func:`gradshare.distributed.hosts.count_ranks_on_host`). A share of one runs every kernel
single-threaded, so numba's pool never starts; a larger share starts it, uses that many of its
threads and puts torch's own setting back as it was.

Set it explicitly with the environment variable ``GRADSHARE_NUM_THREADS`` or
:func:`set_kernel_threads` (before the first kernel call of the process, or the pool stays as
it started).
"""

from __future__ import annotations

import logging
import os
import threading

import torch

from gradshare._checks import check_int

__all__ = ["ENV_VAR", "kernel_threads", "set_kernel_threads"]

logger = logging.getLogger(__name__)

ENV_VAR = "GRADSHARE_NUM_THREADS"
"""The environment variable that sets the kernels' thread count explicitly."""

_lock = threading.Lock()
_explicit: int | None = None
_local_ranks: int | None = None
_torch_threads: int | None = None
_launched = False
_decided: int | None = None
"""The thread count in force (None: decide at the next kernel call)."""
_thread_state = threading.local()
"""Per calling thread: the share of numba's pool it last set."""


def set_kernel_threads(num_threads: int | None) -> None:
    """Use ``num_threads`` threads for the kernels of this process (None: the automatic share).

    Takes effect for every later kernel call; numba's pool is sized once, at the first
    parallel call, so a larger count than the pool started with is capped at the pool's size.
    """
    global _explicit, _decided
    _explicit = None if num_threads is None else check_int(num_threads, "num_threads")
    _decided = None


def _from_env() -> int | None:
    """The count ``GRADSHARE_NUM_THREADS`` sets (read when the count is decided), or None."""
    raw = os.environ.get(ENV_VAR)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"Expect {ENV_VAR} to be an int >= 1, got {raw!r}: unset it or fix it.")
    return value


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _ranks_on_host() -> int:
    """``LOCAL_WORLD_SIZE`` (torchrun's), else the count learned from the group, else 1."""
    raw = os.environ.get("LOCAL_WORLD_SIZE", "")
    if raw.isdigit() and int(raw) > 0:
        return int(raw)
    return 1 if _local_ranks is None else _local_ranks


def torch_threads() -> int:
    """torch's thread count as it was before any kernel of ours ran (read once)."""
    global _torch_threads
    if _torch_threads is None:
        _torch_threads = torch.get_num_threads()
    return _torch_threads


def kernel_threads() -> int:
    """The threads each kernel call of this process uses (1: single-threaded kernels)."""
    decided = _decided
    if decided is None:
        decided = _decide()
    return decided


def _decide() -> int:
    global _decided
    explicit = _explicit if _explicit is not None else _from_env()
    if explicit is not None:
        _decided = explicit
    else:
        _decided = max(1, min(torch_threads(), _usable_cpus() // _ranks_on_host()))
    logger.debug("gradshare kernels: %d thread(s) per call", _decided)
    return _decided


def note_ranks_on_host(count: int) -> None:
    """Record how many ranks of the job run on this host (learned from the process group)."""
    global _local_ranks, _decided
    _local_ranks = check_int(count, "count")
    _decided = None


def parallel_threads() -> int:
    """Start numba's pool (once) and set this thread's share of it; return that share.

    Called before a parallel kernel runs. numba's pool has ``NUMBA_NUM_THREADS`` threads (all
    cores unless set); each calling thread uses only :func:`kernel_threads` of them. torch's
    thread count, which numba's OpenMP layer changes as the pool starts, is put back.
    """
    global _launched
    want = kernel_threads()
    if not _launched:
        with _lock:
            if not _launched:
                _launch_pool()
                _launched = True
    import numba

    share = min(want, numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]
    if getattr(_thread_state, "share", None) != share:
        numba.set_num_threads(share)
        _thread_state.share = share
    return share


def _launch_pool() -> None:
    import numba

    saved = torch_threads()
    numba.get_num_threads()  # starts the pool (NUMBA_NUM_THREADS threads, idle unless asked)
    if torch.get_num_threads() != saved:
        torch.set_num_threads(saved)  # numba's OpenMP start-up changed the shared runtime's
