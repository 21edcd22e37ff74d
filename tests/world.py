"""Run a function on a real world of gloo processes on 127.0.0.1 and collect what each returns.

Each rank is a spawned process joined through a FileStore; it returns its result (or its
traceback) through a file. A rank that is killed or hangs is reported as such, never waited for
past the deadline.
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


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


def _entry(
    fn: Callable[..., Any], rank: int, world: int, tmp: str, args: tuple, pg_s: float
) -> None:
    torch.set_num_threads(1)
    out = Path(tmp) / f"rank{rank}.pt"
    start = time.monotonic()
    store = dist.FileStore(str(Path(tmp) / "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=pg_s))  # fmt: skip
    try:
        value = fn(rank, world, *args)
        result = RankResult(rank, value, elapsed=time.monotonic() - start)
    except BaseException as e:  # reported to the test, which re-raises it
        result = RankResult(rank, None, type(e).__name__, str(e), traceback.format_exc(),
                            elapsed=time.monotonic() - start)  # fmt: skip
    torch.save(result, out)
    if result.error is None:
        dist.destroy_process_group()
    os._exit(0)  # a failed rank leaves at once, as a crashed worker would


def spawn(
    fn: Callable[..., Any], world: int, *args: Any, timeout: float = 90, pg_timeout: float = 60
) -> list[RankResult]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return one result per rank."""
    ctx = mp.get_context("spawn")
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
