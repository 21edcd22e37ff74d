"""LocalSteps that trains on when machines come and go: torchft's quorum underneath.

``LocalSteps(model, opt, sync_every=10, elastic=Elastic(lighthouse))``, one process per
machine (each its own torchft *replica group* of one), no ``init_process_group``: membership
is torchft's (its ``Manager`` for the quorum, the commit and the heal, its lighthouse for who
is there; ``pip install gradshare[ft]``). At every sync:

1. the quorum names who takes part (``Manager.start_quorum``); a rank that joins or comes
   back heals there from a live peer: the global copy, the outer optimizer's state, the
   counters, the inner optimizer's state and whatever else it was given to heal (an LR
   schedule), and its replica becomes the global copy, so it enters with an empty
   pseudo-gradient and an empty residual, and takes part in that very sync;
2. the round runs as always (each rank's Δ into its residual, the header, the exchange of
   the encoded pieces, every piece validated) over the Manager's process group, its errors
   reported to the Manager;
3. the outer step is taken only when the round commits (``Manager.should_commit``). A rank
   lost before or during the round fails it on every survivor: each puts its residuals and
   encoders back, as after any failed exchange, and the round runs again with the new
   quorum, until it commits or the timeout has passed (then every rank raises, naming it).

A rank asked to leave (:meth:`Elastic.leave`, or SIGTERM) sends its whole residual and Δ at
its next sync (dense pieces: nothing it learned is lost), then leaves the quorum; its
LocalSteps stops syncing (``sync.left``). No peer of torchft's does this.

The timeouts are the run's: the quorum, every collective, the commit and the heal wait at
most LocalSteps' ``timeout``, and a lighthouse that does not answer is an error within it. A
heal travels over HTTP in torch's weights-only format (no pickle): tensors, dicts, lists,
numbers. One fragment and no overlap (a leaving rank's whole residual goes at one sync).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
import urllib.parse
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradshare import codec
from gradshare.distributed import exchange
from gradshare.distributed.exchange import ExchangeError
from gradshare.distributed.local_steps import state as state_io
from gradshare.distributed.local_steps.fragment import Fragment
from gradshare.distributed.local_steps.protocol import undone_on_error

__all__ = ["Elastic", "Member", "join", "sync"]

logger = logging.getLogger(__name__)

LocalSteps = Any
"""The :class:`~gradshare.LocalSteps` this runs under (not imported: :mod:`.core` imports
this module)."""


class Elastic:
    """Train on when ranks fail, leave or join, on torchft (the module's docstring tells how).

    Args:
        lighthouse: the torchft lighthouse's address, ``http://HOST:PORT`` (None: the
            ``TORCHFT_LIGHTHOUSE`` environment variable; ``torchft_lighthouse
            --min_replicas 1 --join_timeout_ms 1000`` runs one).
        replica_id: this machine's name in the quorum (default: host name and process id).
        min_replicas: the fewest ranks a round may commit with (>= 1; the lighthouse's
            ``--min_replicas`` should be the same).
        join_timeout: the longest a rank waits for its first quorum at construction: the
            running job's next sync, or the other ranks of a new job (seconds or a
            timedelta; LocalSteps' ``timeout`` bounds every later round).
        heal: other things a joining rank takes from a live peer, by name: objects with
            ``state_dict`` and ``load_state_dict`` (an LR scheduler), beside the global
            copy, the outer optimizer, the counters and the inner optimizer.
        hostname: where the other machines reach this one (its heals and store); default
            the host name.
        leave_on_sigterm: on SIGTERM, leave at the next sync (:meth:`leave`) instead of dying
            with the residual unsent.

    Example::

        >>> elastic = Elastic("http://lighthouse:29510", heal={"lr": scheduler})  # doctest: +SKIP
        >>> sync = LocalSteps(model, opt, sync_every=10, elastic=elastic)  # doctest: +SKIP
    """

    def __init__(
        self,
        lighthouse: str | None = None,
        *,
        replica_id: str | None = None,
        min_replicas: int = 1,
        join_timeout: timedelta | float = timedelta(minutes=10),
        heal: Mapping[str, Any] | None = None,
        hostname: str | None = None,
        leave_on_sigterm: bool = True,
    ) -> None:
        self.lighthouse = lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
        if not self.lighthouse:
            raise ValueError(
                "Expect the lighthouse's address, `lighthouse='http://HOST:PORT'` or the "
                "TORCHFT_LIGHTHOUSE environment variable: the quorum is the lighthouse's "
                "(`torchft_lighthouse --min_replicas 1 --join_timeout_ms 1000` runs one)."
            )
        if isinstance(min_replicas, bool) or not isinstance(min_replicas, int) or min_replicas < 1:
            raise ValueError(f"Expect `min_replicas` to be an int >= 1, got {min_replicas!r}.")
        if not isinstance(join_timeout, timedelta):
            join_timeout = timedelta(seconds=float(join_timeout))
        if join_timeout.total_seconds() <= 0:
            raise ValueError(f"Expect `join_timeout` > 0, got {join_timeout}.")
        heal = dict(heal or {})
        for name, obj in heal.items():
            if not (
                callable(getattr(obj, "state_dict", None))
                and callable(getattr(obj, "load_state_dict", None))
            ):
                raise TypeError(
                    f"Expect every `heal` value to have state_dict() and load_state_dict(), "
                    f"got {type(obj).__name__} for {name!r}."
                )
        self.replica_id = replica_id or f"{socket.gethostname()}-{os.getpid()}"
        self.min_replicas = min_replicas
        self.join_timeout = join_timeout
        self.heal = heal
        self.hostname = hostname or socket.gethostname()
        self.leave_on_sigterm = leave_on_sigterm
        self.leaving = False
        """Set by :meth:`leave` (or SIGTERM): the next sync is this rank's last."""

    def leave(self) -> None:
        """Leave at the next sync, sending the whole residual then (nothing is lost)."""
        self.leaving = True


class Member:
    """This machine in the quorum: its store, torchft Manager and heal transport."""

    def __init__(self, config: Elastic, ls: LocalSteps) -> None:
        try:
            from torchft import Manager, ProcessGroupGloo
        except ImportError as e:
            raise ImportError(
                "LocalSteps(elastic=...) runs on torchft: `pip install gradshare[ft]` (torchft "
                f"0.2, Python 3.11). ({e})"
            ) from None
        self.config = config
        self.ls = ls
        timeout = ls.timeout
        _reach(config.lighthouse, timeout)
        self.store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
        self.transport = _weights_only_transport(timeout)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=None,
            state_dict=None,
            min_replica_size=config.min_replicas,
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=max(timeout, config.join_timeout),
            rank=0,
            world_size=1,
            store_addr=config.hostname,
            store_port=self.store.port,
            lighthouse_addr=config.lighthouse,
            replica_id=config.replica_id,
            hostname=config.hostname,
            checkpoint_transport=self.transport,
            init_sync=True,
        )
        self.manager.register_state_dict_fn("gradshare", self._load, self._save)
        self.healed = False
        """The last quorum healed this rank from a peer."""
        self.committed = False
        """This rank has synced with the others (a heal then keeps what it owes)."""
        if config.leave_on_sigterm:
            signal.signal(signal.SIGTERM, lambda *_: config.leave())

    # ------------------------------------------------------------------ the heal

    def _save(self) -> dict[str, Any]:
        """What a joining rank takes from this one: the shared parts of LocalSteps' state,
        the inner optimizer's state, and the other things to heal."""
        saved = state_io.state_dict(self.ls)
        mine = {
            **saved,
            "encoders": [{**e, "residual": None} for e in saved["encoders"]],
            "base": None,
            "bytes_sent": 0,
            "dense_bytes": 0,
        }
        extra = {name: obj.state_dict() for name, obj in self.config.heal.items()}
        return {"local_steps": mine, "inner": self.ls.inner.state_dict(), "extra": extra}

    def _load(self, state: dict[str, Any]) -> None:
        """Take a live peer's state (the heal); the replica becomes the global copy. A rank
        that synced with the others before and missed a quorum (it was slow) keeps what it
        owes, β·residual + Δ, in its residual: sent at its next sync, not lost."""
        ls = self.ls
        owed = self._owed() if self.committed else None
        state_io.load_state_dict(ls, state["local_steps"])
        ls.inner.load_state_dict(state["inner"])
        for name, obj in self.config.heal.items():
            obj.load_state_dict(state["extra"][name])
        with torch.no_grad():
            for p, g in zip(ls.params, ls.global_params, strict=True):
                p.copy_(g)
            for enc, kept in zip(ls.encoders, owed or [], strict=False):
                enc.residual = kept
        self.healed = True

    def _owed(self) -> list[torch.Tensor] | None:
        """β·residual + (global copy - replica) per encoder, as a sync computes it."""
        ls = self.ls
        if not ls.encoders:
            logger.warning(
                "LocalSteps: dense syncs keep no residual; the round this rank missed is dropped"
            )
            return None
        owed = []
        for enc, p, g in zip(ls.encoders, ls.params, ls.global_params, strict=False):
            local = p.detach().to(ls.home, torch.float32).reshape(-1)
            start = g.detach().reshape(-1).to(torch.float32)
            d = torch.empty_like(local)
            if enc.residual is None:
                codec.subtract_(start, local, d)
            else:  # the Δ pass's own kernel: the residual stays as it is
                codec.decay_into_(enc.residual, ls.decay, d, start, local)
            owed.append(d)
        return owed

    # ------------------------------------------------------------------ a round

    def quorum(self, wait: timedelta) -> tuple[int, int]:
        """Join the quorum of this sync (a heal, if this rank is behind), waiting at most
        ``wait``; (rank, ranks)."""
        self.healed = False
        try:
            self.manager.start_quorum(timeout=wait)
        except Exception as e:
            raise ExchangeError(
                f"LocalSteps: no quorum of {self.config.min_replicas} rank(s) formed at the "
                f"lighthouse {self.config.lighthouse} within {wait.total_seconds():g} s: too "
                f"few ranks are up, or the lighthouse is gone ({type(e).__name__}: {e})."
            ) from e
        rank, world = self.manager.participating_rank(), self.manager.num_participants()
        if self.healed:
            t = self.transport
            logger.info(
                "LocalSteps: healed from a peer at step %d: %.1f MB in %.3f s",
                self.ls.steps,
                t.bytes / 1e6,
                t.seconds,
            )
        if rank is None:
            raise ExchangeError("LocalSteps: this rank is not part of the quorum (a spare).")
        pg = self.manager._pg
        exchange.name_group(pg, rank, [f"replica {r}" for r in range(world)])
        return rank, world

    def get(self) -> dist.ProcessGroup:
        """The process group of this quorum's ranks (torchft's, rebuilt at each quorum)."""
        return self.manager._pg

    @property
    def timeout(self) -> timedelta:
        return self.ls.timeout

    def commit(self) -> bool:
        """Whether every rank of the quorum got through the round (torchft's commit)."""
        return bool(self.manager.should_commit())

    def shutdown(self) -> None:
        exchange.name_group(self.manager._pg, None, None)
        self.manager.shutdown(wait=False)


def join(ls: LocalSteps, member: Member) -> None:
    """At construction: the first quorum (a heal from a live peer for a rank that joins a
    running job; from the first rank for every rank of a new job), and the sync the others
    are at, which this rank enters with an empty pseudo-gradient."""
    sync(ls, ls._fragments[0], member, member.config.join_timeout)


def sync(ls: LocalSteps, frag: Fragment, member: Member, wait: timedelta | None = None) -> None:
    """One sync under torchft: run the round with the quorum of the moment until it commits,
    then the outer step. It fails once ``wait`` (default the timeout) has passed and the
    next quorum has the same ranks: one that lost a rank (dropped after a collective timed
    out on a hung one) gets the whole ``wait`` again."""
    wait = wait or ls.timeout
    deadline = time.monotonic() + wait.total_seconds()
    leaving = member.config.leaving
    failure: BaseException | None = None
    world = 0
    while True:
        before_world = world
        if failure is not None and world < member.config.min_replicas:
            if time.monotonic() > deadline:  # too few: another quorum would be as small
                _give_up(ls, member, wait, world, failure)
        rank, world = member.quorum(wait if failure else _left(deadline))
        if failure is not None:
            if world != before_world:  # another quorum: progress
                deadline = time.monotonic() + wait.total_seconds()
            elif time.monotonic() > deadline:
                _give_up(ls, member, wait, world, failure)
        ls._protocol.reconfigure(rank, world)
        failure = None
        before: list[dict[str, Any]] = []
        sent = 0
        try:
            sent += ls._protocol.begin(frag, ls.syncs, ls.decay, False, whole=leaving)
            job, before = ls._protocol.mean_job(frag, ls.syncs, ls._unsent, ls.outer)
            sent += undone_on_error(frag, before, job)
        except Exception as e:  # a peer lost (or its group not formed): the round fails everywhere
            member.manager.report_error(e)
            failure = e
        except BaseException:
            member.manager.report_error(RuntimeError("this rank stopped"))
            raise
        if member.commit():
            break
        if failure is None:  # the exchange went through here, a peer's did not
            frag.put_back(before)
            frag.received = None  # pieces held for plain SGD's step: not this round's now
            failure = RuntimeError("a rank of the quorum failed the round")
        logger.info(
            "LocalSteps: round %d failed (%s); again with the next quorum", ls.syncs, failure
        )
    member.committed = True
    ls.bytes_sent += sent
    ls._step(frag)
    frag.take_global()
    ls.dense_bytes += 4 * frag.numel
    ls.syncs += 1
    if leaving:
        member.shutdown()
        ls.left = True


def _left(deadline: float) -> timedelta:
    return timedelta(seconds=max(0.1, deadline - time.monotonic()))


def _give_up(
    ls: LocalSteps, member: Member, wait: timedelta, world: int, failure: BaseException
) -> None:
    few = member.config.min_replicas
    why = (
        f"the quorum had {world} rank(s), fewer than the {few} of `min_replicas`"
        if world < few
        else str(failure)
    )
    raise ExchangeError(
        f"LocalSteps sync round {ls.syncs}: no quorum committed the round within "
        f"{wait.total_seconds():g} s: {why}."
    )


def _reach(lighthouse: str | None, timeout: timedelta) -> None:
    """Raise within ``timeout`` unless something listens at the lighthouse's address."""
    url = urllib.parse.urlparse(
        lighthouse if "://" in (lighthouse or "") else f"http://{lighthouse}"
    )
    host, port = str(url.hostname or "localhost"), url.port or 29510
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError as e:
            if time.monotonic() > deadline:
                raise ExchangeError(
                    f"LocalSteps: no lighthouse answers at {lighthouse} within the timeout "
                    f"({timeout.total_seconds():g} s) ({e}): start one (torchft_lighthouse "
                    "--min_replicas 1 --join_timeout_ms 1000) or pass its address."
                ) from None
            time.sleep(0.2)


def _weights_only_transport(timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport, reading with ``weights_only=True`` (torchft's
    own reads with pickle)."""
    from torch.distributed._serialization import _streaming_load
    from torchft.checkpointing.http_transport import HTTPTransport

    class WeightsOnly(HTTPTransport):
        seconds, bytes = 0.0, 0
        """The last heal's transfer: wall seconds and tensor bytes."""

        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            import urllib.request

            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
                return _streaming_load(f, weights_only=True)

        def recv_checkpoint(
            self, src_rank: int, metadata: str, step: int, timeout: timedelta
        ) -> Any:
            start = time.monotonic()
            state = super().recv_checkpoint(src_rank, metadata, step, timeout)
            self.seconds = time.monotonic() - start
            tensors = torch.utils._pytree.tree_leaves(state)
            self.bytes = sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))
            return state

    return WeightsOnly(timeout=timeout, num_chunks=0)
