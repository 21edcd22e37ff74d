"""The message exchange over torch.distributed, and the ordered pipeline that runs it.

Where DL4J sends each message over its own UDP transport, gradshare exchanges them with the
collectives PyTorch users already run (gloo on CPU, NCCL on CUDA), launched by ``torchrun``:

1. every rank all-gathers a small header ``[status, words, numel, round]`` (fixed size);
2. every rank checks that none failed locally, that all are at the same round (the caller's
   step or iteration: a rank resumed from a stale checkpoint is caught here, never averaged in),
   that all encode vectors of one size, and that no claimed length exceeds the largest valid
   message for that size;
3. every rank all-gathers its int32 message padded to the longest, and trims each back.

Nothing is pickled: only int64 headers and int32 messages travel. The receivers validate each
message whole before any element is decoded (:func:`gradshare.codec.decode_sum_`), so a
corrupted one raises the same :class:`~gradshare.codec.MessageError` on every rank.

:class:`Pipeline` runs exchanges in a background thread, one after the other in the order they
were submitted, so that every rank issues its collectives in the same order while the caller
goes on (the DDP hook: bucket k is exchanged while backward computes bucket k+1).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from gradshare import codec
from gradshare._checks import to_seconds
from gradshare.codec import multipart
from gradshare.distributed import _inflight

__all__ = [
    "ExchangeError",
    "GroupSource",
    "Pipeline",
    "PrivateGroup",
    "collective",
    "Pieces",
    "exchange_messages",
    "exchange_pieces",
    "gather_pieces",
    "global_ranks",
    "largest_message",
    "name_group",
    "rank_names",
    "take_back",
    "this_rank",
]

_OK, _FAILED = 0, 1
T = TypeVar("T")
logger = logging.getLogger(__name__)


class ExchangeError(RuntimeError):
    """The exchange of messages failed on this rank because of another rank (or the network)."""


def collective(
    op: Callable[..., Any],
    *tensors: torch.Tensor | list[torch.Tensor],
    timeout: timedelta,
    what: str,
    rank: int,
    **kwargs: Any,
) -> None:
    """Run the collective ``op(*tensors, **kwargs)`` (``dist.all_gather``, ``dist.broadcast``,
    …) asynchronously and wait for it; on failure or timeout raise :class:`ExchangeError`
    naming ``what`` and this ``rank``. Once it has completed, the call returns only after the
    backend has dropped its work, so that the process can exit, or destroy the group, cleanly
    right after (see :mod:`gradshare.distributed._inflight`).
    """
    work = _inflight.issue(lambda: op(*tensors, async_op=True, **kwargs), tensors)
    start = time.monotonic()
    try:
        work.wait(timeout)
    except Exception as e:
        error = e
    else:  # the backend lets go of the work before the call returns (see _inflight)
        del work
        _inflight.settle(tensors)
        return
    # the traceback keeps this frame until exit: it must not keep the work, or the backend
    # could not drop it before exit (see _close_all)
    del work
    text = f"{type(error).__name__}: {error}"
    if any(sign in text for sign in _MISMATCH):
        cause = (
            "the ranks issued different collectives (their settings or steps differ: build "
            "every rank alike and resume every rank from the same step)"
        )
    else:
        cause = (
            "a peer raised, was killed, or the network is down; or the ranks issued different "
            "collectives (their settings or steps differ)"
        )
    raise ExchangeError(
        f"Rank {rank}: the {what} failed after {time.monotonic() - start:.1f} s (timeout "
        f"{timeout.total_seconds():g} s): {cause}. Original error: {text}"
    ) from error


_MISMATCH = ("EnforceNotMet", "collective mismatch", "size doesn't match", "size mismatch")
"""What a backend's error says when the ranks' collectives did not match."""


_NAMED: dict[int, tuple[int, list[str]]] = {}
"""Groups torch does not know (torchft's, rebuilt at each quorum): id -> (this process's rank
in it, each rank's name), for errors (:func:`name_group`)."""


def name_group(group: dist.ProcessGroup, rank: int | None, names: list[str] | None) -> None:
    """Record this process's rank in ``group`` and its ranks' names (None: forget it): for a
    group outside torch's registry, whose ranks have no global rank."""
    if rank is None or names is None:
        _NAMED.pop(id(group), None)
    else:
        _NAMED[id(group)] = (rank, names)


def this_rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank, for errors: its global rank, or its rank in a named group."""
    named = _NAMED.get(id(group))
    if named is not None and not dist.is_initialized():
        return named[0]
    return dist.get_rank() if dist.is_initialized() else 0


def global_ranks(group: dist.ProcessGroup | None = None) -> list[int]:
    """The global rank of each rank of ``group``, in group order (errors name global ranks);
    for a named group, its ranks' positions."""
    if id(group) in _NAMED:
        return list(range(len(_NAMED[id(group)][1])))
    return dist.get_process_group_ranks(group or dist.group.WORLD)


def rank_names(world: int, group: dist.ProcessGroup | None = None) -> list[str]:
    """How errors name the messages of an exchange over ``group``, by position: by global
    rank (the ranks of a world of ``world`` when no group is given; a named group's names)."""
    if id(group) in _NAMED:
        return _NAMED[id(group)][1][:world]
    ranks = global_ranks(group) if dist.is_initialized() else list(range(world))
    return [f"rank {r}" for r in ranks[:world]]


def largest_message(numel: int) -> int:
    """Words of the longest valid message for ``numel`` elements: sparse with every element
    (N + 4) or a bitmap (N//16 + 5), whichever is longer."""
    return max(codec.sparse_length(numel), codec.bitmap_length(numel))


def exchange_messages(
    message: torch.Tensor | None,
    numel: int,
    *,
    group: dist.ProcessGroup | None = None,
    timeout: float | timedelta | None = None,
    device: torch.device | None = None,
    failure: BaseException | None = None,
    max_words: int | None = None,
    round: int = -1,
) -> list[torch.Tensor | None]:
    """All-gather every rank's message for a vector of ``numel`` elements, in rank order.

    ``message`` is this rank's int32 message or None (nothing to send). Pass ``failure`` when
    this rank could not encode: the others then raise :class:`ExchangeError` naming it, and
    this rank re-raises ``failure`` — so one rank's bad input stops every rank, promptly.
    Decode them with :func:`gradshare.codec.decode_sum_` or :func:`~gradshare.codec.subtract_sum_`,
    which validate each whole first and name a bad one's rank.

    ``max_words`` caps the words a rank may claim (default :func:`largest_message` of
    ``numel``): a message that concatenates one piece per parameter (the DDP hook's) is capped
    at the sum of its pieces' largest messages.

    ``round`` is the caller's step or iteration (-1: none): ranks at different rounds (one
    resumed from a stale checkpoint) raise the same error naming each rank's, before anything
    is exchanged.

    Raises:
        ExchangeError: another rank failed, the ranks are at different rounds, the ranks'
            vector sizes differ, a rank claims a
            longer message than any valid one (nothing is allocated for it), or a collective
            failed or timed out.
    """
    timeout = timedelta(seconds=to_seconds(timeout))
    rank = this_rank(group)
    world = dist.get_world_size(group)
    ranks = global_ranks(group)
    if device is None:
        device = message.device if message is not None else torch.device("cpu")
    words = 0 if message is None else message.numel()
    status = _OK if failure is None else _FAILED
    header = torch.tensor([status, words, numel, round], dtype=torch.int64, device=device)
    headers = [torch.empty_like(header) for _ in range(world)]
    collective(
        dist.all_gather,
        headers,
        header,
        group=group,
        timeout=timeout,
        what="size exchange",
        rank=rank,
    )
    table = torch.stack(headers).cpu().tolist()
    failed = [ranks[r] for r, h in enumerate(table) if h[0] != _OK]
    if failure is not None:
        raise failure
    if failed:
        raise ExchangeError(
            f"Rank {rank}: rank(s) {failed} failed to encode their update this step (see their "
            "own error); every rank stops here."
        )
    if len({h[3] for h in table}) != 1:
        at = ", ".join(f"{h[3]} on rank {ranks[r]}" for r, h in enumerate(table))
        raise ExchangeError(
            f"The ranks are at different iterations ({at}): nothing was exchanged. Every rank "
            "must resume from the checkpoint of the same step (a stale per-rank checkpoint?)."
        )
    sizes = {ranks[r]: h[2] for r, h in enumerate(table)}
    if len(set(sizes.values())) != 1:
        raise ExchangeError(
            f"Rank {rank}: the ranks share vectors of different sizes {sizes}: every rank must "
            "hold the same model (same parameters, same order)."
        )
    cap = largest_message(numel) if max_words is None else max_words
    claims = {ranks[r]: h[1] for r, h in enumerate(table) if not 0 <= h[1] <= cap}
    if claims:
        raise ExchangeError(
            f"Rank {rank}: rank(s) {sorted(claims)} claim messages of {claims} words, but no "
            f"valid message for {numel} elements is longer than {cap}: nothing was allocated; "
            "those ranks run another program or their memory is corrupted."
        )
    longest = max(h[1] for h in table)
    if longest == 0:
        return [None] * world
    padded = torch.zeros(longest, dtype=torch.int32, device=device)
    if message is not None:
        padded[:words].copy_(message)
    gathered = [torch.empty_like(padded) for _ in range(world)]
    collective(
        dist.all_gather,
        gathered,
        padded,
        group=group,
        timeout=timeout,
        what="message exchange",
        rank=rank,
    )
    return [m[: h[1]] if h[1] else None for h, m in zip(table, gathered, strict=True)]


@dataclass(frozen=True, slots=True)
class Pieces:
    """Every rank's multipart message of a round, cut into its validated pieces
    (:func:`gather_pieces`): what :func:`exchange_pieces` decodes."""

    by_rank: list[list[torch.Tensor | None]]
    """Per rank, per target: its piece (sparse once expanded, a bitmap or a dense piece), or
    None where it sent nothing."""
    names: list[str]
    """The ranks' names, for errors."""
    sent: int
    """The bytes this rank sent."""

    def of(self, i: int) -> list[torch.Tensor | None]:
        """Every rank's piece of target ``i``, in rank order."""
        return [pieces[i] for pieces in self.by_rank]


def gather_pieces(
    message: torch.Tensor | None,
    sizes: Sequence[int],
    labels: Sequence[Any],
    *,
    group: Any,
    timeout: float | timedelta | None,
    device: torch.device,
    home: torch.device,
    failure: BaseException | None = None,
    round: int = -1,
) -> Pieces:
    """Exchange every rank's multipart message, one piece per vector of ``sizes`` back to
    back (:func:`gradshare.codec.multipart.join_messages`), and cut each into its pieces on
    ``home``, every piece validated whole (a bad one raises
    :class:`gradshare.MessageError` naming the rank and ``labels[i]``). ``failure``,
    ``round`` and the errors are :func:`exchange_messages`'; each rank's message is capped at
    the sum of its pieces' longest valid messages."""
    messages = exchange_messages(
        message,
        sum(sizes),
        group=group,
        timeout=timeout,
        device=device,
        failure=failure,
        max_words=sum(largest_message(n) for n in sizes),
        round=round,
    )
    names = rank_names(len(messages), group)
    by_rank = [
        multipart.split_message(None if m is None else m.to(home), sizes, name, labels)
        for m, name in zip(messages, names, strict=True)
    ]
    return Pieces(by_rank, names, 0 if message is None else 4 * message.numel())


def exchange_pieces(
    message: torch.Tensor | None,
    targets: Sequence[torch.Tensor],
    labels: Sequence[Any],
    *,
    group: dist.ProcessGroup | None,
    timeout: float | timedelta | None,
    device: torch.device,
    divisor: float,
    failure: BaseException | None = None,
    round: int = -1,
) -> int:
    """:func:`gather_pieces`, then overwrite each target with the sum of its pieces decoded
    in rank order, divided by ``divisor``: the DDP hook's bucket and LocalSteps' round. The
    messages travel on ``device`` and are decoded where the targets live; no target is
    written unless every piece is valid. Returns the bytes this rank sent."""
    pieces = gather_pieces(
        message,
        [t.numel() for t in targets],
        labels,
        group=group,
        timeout=timeout,
        device=device,
        home=targets[0].device,
        failure=failure,
        round=round,
    )
    for i, target in enumerate(targets):
        codec.decode_sum_(pieces.of(i), target, divisor=divisor, names=pieces.names, checked=True)
    return pieces.sent


def take_back(message: torch.Tensor, residual: torch.Tensor) -> None:
    """Put this rank's own ``message`` back into its ``residual`` after a failed exchange (the
    sum was not applied), so that nothing of it is lost; a message that is itself invalid (a
    corrupted one, refused by the exchange) is left out."""
    with contextlib.suppress(codec.MessageError):
        codec.decode_(message, residual)


class GroupSource(Protocol):
    """Where a front end's collectives run: :class:`PrivateGroup`, or an elastic member's
    group of the moment."""

    @property
    def timeout(self) -> timedelta: ...

    def get(self) -> dist.ProcessGroup: ...


class PrivateGroup:
    """A private twin of a process group, over the same ranks, whose own timeout is
    gradshare's: made on first use, held weakly.

    Two reasons to exchange over it rather than over the user's group. A gloo operation that
    gradshare stopped waiting for keeps running until its group's own timeout (30 minutes
    with a plain ``init_process_group("gloo")``), and until then the process cannot exit, not
    even after ``destroy_process_group()``; on the twin it ends at gradshare's timeout. And
    collectives that gradshare issues from a background thread never interleave with those
    the user or DDP issue on theirs. Held weakly, so that ``destroy_process_group()`` frees
    it with the others (a group that outlives the interpreter aborts the process at exit);
    a later use makes a new one.

    Its first use is a collective of the group's ranks (``use_local_synchronization``: only
    they take part). With ``ranks`` (global ranks) it is a group of those ranks instead of a
    twin (the nodes and node leaders of the hierarchical exchange); only they may use it.
    """

    def __init__(
        self, group: dist.ProcessGroup | None, timeout: timedelta, ranks: list[int] | None = None
    ) -> None:
        self.parent = group
        self.timeout = timeout
        self.ranks = ranks
        self._ref: weakref.ref[dist.ProcessGroup] | None = None

    def get(self) -> dist.ProcessGroup:
        group = None if self._ref is None else self._ref()
        if group is None:
            ranks = self.ranks or dist.get_process_group_ranks(self.parent or dist.group.WORLD)
            start = time.monotonic()
            try:
                group = dist.new_group(ranks, timeout=self.timeout, use_local_synchronization=True)
            except Exception as e:
                raise ExchangeError(
                    f"Rank {dist.get_rank()}: making gradshare's exchange group over ranks "
                    f"{ranks} failed after {time.monotonic() - start:.1f} s (timeout "
                    f"{self.timeout.total_seconds():g} s): a peer has not started, raised, or "
                    f"is gone. Original error: {type(e).__name__}: {e}"
                ) from e
            self._ref = weakref.ref(group)
            _private.add(self)
        return group

    def destroy(self) -> None:
        """Destroy the twin group if it still exists (at exit: see :func:`_close_all`)."""
        group = None if self._ref is None else self._ref()
        self._ref = None
        if group is not None and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group(group)


_open: weakref.WeakSet[Pipeline] = weakref.WeakSet()
"""Pipelines whose thread runs."""


_private: weakref.WeakSet[PrivateGroup] = weakref.WeakSet()
"""Private groups made in this process."""


@atexit.register
def _close_all() -> None:
    """At interpreter exit, while it is still whole: end the pipelines' threads, wait until
    the backend has dropped every work of ours (:func:`gradshare.distributed._inflight.drain`), and
    destroy the private groups. Left to the interpreter's teardown, any of them could abort
    the process ("terminate called without an active exception")."""
    for pipeline in list(_open):
        pipeline.close()
    if not _inflight.drain(timeout=10.0):
        logger.warning(
            "gradshare: a collective was still running at exit after 10 s (a peer hung?); "
            "the process may abort as the interpreter shuts down"
        )
    for group in list(_private):
        group.destroy()


class Pipeline:
    """Run jobs one at a time, in submission order, in one background thread.

    Each :meth:`submit` returns a ``torch.futures.Future`` that completes with the job's
    result (or its exception). Jobs that issue collectives therefore issue them in the same
    order on every rank, as long as every rank submits in the same order. After a job fails,
    the jobs already queued behind it fail at once with the same error (their collectives
    would only wait for a peer that is gone) until :meth:`clear_failure`.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[tuple[Any, Any]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], T]) -> torch.futures.Future[T]:
        future: torch.futures.Future[T] = torch.futures.Future()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
                _open.add(self)
        self._jobs.put((job, future))
        return future

    def close(self, timeout: float = 10.0) -> None:
        """Let the queued jobs finish, then end the thread (a later submit starts a new one).

        Called for every pipeline at interpreter exit: a thread of ours still alive while the
        interpreter and torch's C++ state are torn down can abort the process ("terminate
        called without an active exception").
        """
        with self._lock:
            thread, self._thread = self._thread, None
            _open.discard(self)
        if thread is not None:
            self._jobs.put((None, None))
            thread.join(timeout)

    def clear_failure(self) -> None:
        """Let the next job run again after a failure (called at a pass's end)."""
        self._jobs.put((self._clear, torch.futures.Future()))

    def _clear(self) -> None:
        self._failure = None

    def _run(self) -> None:
        while True:
            job, future = self._jobs.get()
            if job is None:
                return
            self._step(job, future)
            del job, future  # hold nothing of a job between jobs

    def _step(self, job: Callable[[], Any], future: torch.futures.Future[Any]) -> None:
        clearing = job == self._clear
        if self._failure is not None and not clearing:
            future.set_exception(self._failure)
            return
        try:
            result = job()
        except BaseException as e:
            if not clearing:
                self._failure = e
            future.set_exception(e)
        else:
            future.set_result(result)
