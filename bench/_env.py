"""The machine and versions a benchmark ran on, saved with its results."""

from __future__ import annotations

import contextlib
import os
import platform
import socket
import time
from pathlib import Path

import numba
import numpy as np
import torch


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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
