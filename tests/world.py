"""Run a function on a real world of gloo processes on 127.0.0.1 and collect what each returns.

Each rank is a spawned process joined through a FileStore; it returns its result (or its
traceback) through a file. A rank that is killed or hangs is reported as such, never waited for
past the deadline.

:func:`spawn` starts a fresh world for one function (for tests that kill or hang a rank, time
it, or need a process of their own). :func:`pooled` runs the function on a world kept alive
for the whole session, one per world size, since each spawned rank spends seconds importing
torch and gradshare: each call runs ``fn`` on every rank of the same processes and process
group, with the environment and torch's thread count as the rank started. A world whose call
did not end cleanly on every rank (an error, a killed or hung rank) is ended, and the next
call gets a fresh one.

Ranks start from a forkserver that has imported torch and gradshare once (a fork of a
process that ran no torch op and started no thread), not each from nothing as the "spawn"
method does: a rank is then ready in a fraction of a second, not two.
"""

from __future__ import annotations

import atexit
import itertools
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if TYPE_CHECKING:  # the ranks import this module: not pytest too
    import pytest

_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "gradshare",
    "gradshare.distributed",
    "world",
]
"""What the forkserver imports once. torch._dynamo too: torch imports it the first time any
optimizer is built (1.2 s of CPU a process here), and it starts no thread."""


def _context() -> Any:
    """The start method of every rank: a forkserver with :data:`_PRELOAD` imported."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


@dataclass
class RankResult:
    rank: int
    value: Any = None
    error: str | None = None  # exception type name
    message: str = ""
    traceback: str = ""
    exitcode: int | None = None
    elapsed: float = 0.0

    def get(self) -> Any:
        """The value, or an AssertionError carrying the rank's own traceback."""
        if self.error is not None or self.exitcode not in (0, None):
            raise AssertionError(
                f"rank {self.rank} failed ({self.error or f'exit code {self.exitcode}'}):\n"
                f"{self.traceback}"
            )
        return self.value


def _call(fn: Callable[..., Any], rank: int, world: int, args: tuple, start: float) -> RankResult:
    """``fn(rank, world, *args)``: its value, or its error and traceback; the seconds since
    ``start``."""
    try:
        value = fn(rank, world, *args)
        return RankResult(rank, value, elapsed=time.monotonic() - start)
    except BaseException as e:  # reported to the test, which re-raises it
        return RankResult(
            rank,
            error=type(e).__name__,
            message=str(e),
            traceback=traceback.format_exc(),
            elapsed=time.monotonic() - start,
        )


def _entry(
    fn: Callable[..., Any], rank: int, world: int, tmp: str, args: tuple, pg_s: float
) -> None:
    torch.set_num_threads(1)
    out = Path(tmp) / f"rank{rank}.pt"
    start = time.monotonic()
    store = dist.FileStore(str(Path(tmp) / "store"), world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=pg_s)
    )
    result = _call(fn, rank, world, args, start)
    torch.save(result, out)
    if result.error is None:
        dist.destroy_process_group()
    os._exit(0)  # a failed rank leaves at once, as a crashed worker would


def spawn(
    fn: Callable[..., Any], world: int, *args: Any, timeout: float = 90, pg_timeout: float = 60
) -> list[RankResult]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return one result per rank."""
    ctx = _context()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world, tmp, args, pg_timeout), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
        results = []
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join()
                results.append(
                    RankResult(r, error="Hang", message=f"still running after {timeout} s")
                )
                continue
            path = Path(tmp) / f"rank{r}.pt"
            if path.exists():
                res = torch.load(path, weights_only=False)
                res.exitcode = p.exitcode
                results.append(res)
            else:
                results.append(RankResult(r, error="Killed", exitcode=p.exitcode))
        return results


def _serve(rank: int, world: int, tmp: str, inbox: Any, pg_s: float) -> None:
    """A rank of a pooled world: join the group, then run each job of ``inbox`` in turn."""
    torch.set_num_threads(1)
    store = dist.FileStore(str(Path(tmp) / "store"), world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=pg_s)
    )
    environ = dict(os.environ)
    while (job := inbox.get()) is not None:
        fn, args = torch.load(job, weights_only=False)
        result = _call(fn, rank, world, args, time.monotonic())
        out = f"{job}.rank{rank}"
        torch.save(result, out + ".tmp")
        os.replace(out + ".tmp", out)
        if result.error is not None:
            os._exit(0)  # a failed rank leaves at once, as a crashed worker would
        del fn, args, result
        os.environ.clear()  # as the rank started, for the next job
        os.environ.update(environ)
        torch.set_num_threads(1)
    dist.destroy_process_group()
    os._exit(0)


class _World:
    """``world`` live ranks serving jobs; see :func:`pooled`."""

    def __init__(self, world: int, pg_timeout: float) -> None:
        ctx = _context()
        self.world = world
        self.tmp = tempfile.TemporaryDirectory()
        self.jobs = itertools.count()
        self.inboxes = [ctx.SimpleQueue() for _ in range(world)]
        self.procs = [
            ctx.Process(target=_serve, args=(r, world, self.tmp.name, q, pg_timeout), daemon=True)
            for r, q in enumerate(self.inboxes)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable[..., Any], args: tuple, timeout: float) -> list[RankResult]:
        """Run ``fn(rank, world, *args)`` on every rank; as :func:`spawn`, one result a rank."""
        job = str(Path(self.tmp.name) / f"job{next(self.jobs)}")
        torch.save((fn, args), job)
        for q in self.inboxes:
            q.put(job)
        deadline = time.monotonic() + timeout
        results: list[RankResult | None] = [None] * self.world
        while None in results and time.monotonic() < deadline:
            for r, p in enumerate(self.procs):
                if results[r] is not None:
                    continue
                path = Path(f"{job}.rank{r}")
                if path.exists():
                    results[r] = torch.load(path, weights_only=False)
                elif not p.is_alive() and not path.exists():
                    results[r] = RankResult(r, error="Killed", exitcode=p.exitcode)
            time.sleep(0.01)
        for r, p in enumerate(self.procs):
            res = results[r]
            if res is None:
                results[r] = RankResult(r, error="Hang", message=f"still running after {timeout} s")
            elif res.error is not None:
                p.join(max(0.1, deadline - time.monotonic()))  # it is leaving
                res.exitcode = p.exitcode
        return [r for r in results if r is not None]

    def close(self, kill: bool = False) -> None:
        for p, q in zip(self.procs, self.inboxes, strict=True):
            if kill:
                p.kill()
            elif p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
        self.tmp.cleanup()


_worlds: dict[int, _World] = {}


def pooled(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 90) -> list[RankResult]:
    """As :func:`spawn`, on the session's live world of ``world`` ranks (started if need be).

    For functions that leave every rank healthy and the group usable when they succeed; a
    call with any failed, killed or hung rank ends that world (the next call starts another).
    """
    w = _worlds.get(world) or _worlds.setdefault(world, _World(world, pg_timeout=60))
    results = w.run(fn, args, timeout)
    if any(r.error is not None or r.exitcode not in (0, None) for r in results):
        del _worlds[world]
        w.close(kill=True)
    return results


@atexit.register
def close_worlds() -> None:
    """End every live world (at exit; a test may call it to start from fresh ones)."""
    while _worlds:
        _worlds.popitem()[1].close()


def selected(request: pytest.FixtureRequest, test: str) -> list[dict[str, Any]]:
    """The parameters of every selected test named ``test`` in the requesting module ({} for
    one not parametrized): what a module fixture that starts the tests' runs ahead needs."""
    import pytest

    return [
        item.callspec.params if hasattr(item, "callspec") else {}
        for item in request.session.items
        if isinstance(item, pytest.Function)
        and item.module is request.module
        and item.originalname == test
    ]
