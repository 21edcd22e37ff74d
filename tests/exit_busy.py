"""One rank of a job on a loaded machine that leaves right after its last exchange.

The load is made deterministic: every thread of the process runs on one CPU, and the
backend's threads (gloo's workers and transport loops) run only when nothing else of the
process can. After its last step the rank runs C code that keeps the GIL for a while (as
many extensions do), then leaves the normal way, without ``destroy_process_group``.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/exit_busy.py {shared,hook}
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys

import torch.distributed as dist

from fault_exit import job, step  # this script's directory is on sys.path


def starve_backend_threads() -> None:
    """Pin every thread to one CPU; give the backend's threads the idle scheduling class."""
    cpu = min(os.sched_getaffinity(0))
    for path in glob.glob("/proc/self/task/*/comm"):
        tid = int(path.split("/")[-2])
        os.sched_setaffinity(tid, {cpu})
        with open(path) as f:
            if f.read().strip() in ("pt_gloo_runloop", "gloo_tcp_loop"):
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))


def main() -> None:
    dist.init_process_group("gloo")
    net, opt = job(sys.argv[1], timeout=20)
    starve_backend_threads()
    for _ in range(3):
        step(net, opt)
    print("trained", flush=True)
    ctypes.PyDLL(None).usleep(300_000)  # C code that keeps the GIL (PyDLL does not release it)


if __name__ == "__main__":
    main()
