"""The machine and versions a benchmark ran on, saved with its results; the timed-step loop."""

from __future__ import annotations

import contextlib
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import numba
import numpy as np
import torch
import torch.distributed as dist

from gradshare.distributed.hosts import rendezvous_port


def environment() -> dict[str, object]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "numba": numba.__version__,
        "numpy": np.__version__,
        "numba_threads": numba.config.NUMBA_NUM_THREADS,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a world's rendezvous."""
    return rendezvous_port()


def timed_steps(
    step: Callable[[int], object],
    *,
    steps: int,
    warmup: int,
    budget_s: float,
    at_warmup: Callable[[], object] = lambda: None,
) -> list[float]:
    """Seconds of each timed ``step(i)`` of a distributed run, the same on every rank.

    Each step starts after a barrier and counts as long as its slowest rank took (max over
    ranks). The first ``warmup`` steps are not timed (``at_warmup()`` runs before the first
    timed one, after its barrier: read byte counters there); then up to ``steps`` timed ones,
    fewer once ``budget_s`` seconds are spent (at least 2)."""
    times: list[float] = []
    spent, i = 0.0, 0
    while len(times) < steps and (spent < budget_s or len(times) < 2):
        dist.barrier()
        if i == warmup:
            at_warmup()
        start = time.perf_counter()
        step(i)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times.append(float(elapsed))
            spent += float(elapsed)
        i += 1
    return times
