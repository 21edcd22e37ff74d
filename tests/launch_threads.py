"""A rank of a default launch (mp.spawn as in PyTorch's DDP tutorial, or torchrun) that reports
the thread counts gradshare's kernels and torch use; the test asserts on them.

    python tests/launch_threads.py spawn OUT_DIR shared,hook
    torchrun --standalone --nproc_per_node=2 tests/launch_threads.py torchrun OUT_DIR shared,hook

Each mode (SharedOptimizer, the DDP hook) runs in turn in the same ranks and writes
``OUT_DIR/rank{r}-{mode}.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradshare
from gradshare.codec import threads
from gradshare.distributed.hosts import rendezvous_port


def run(rank: int, world: int, out: str, modes: str) -> None:
    """Each of ``modes`` (comma-separated) in turn, in this one process: a report per mode."""
    torch_before = torch.get_num_threads()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for mode in modes.split(","):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))  # 137k
        if mode == "hook":
            model = DDP(model)
            gradshare.register_threshold_hook(model)
            opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        else:
            opt = gradshare.SharedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        for step in range(4):
            opt.zero_grad()
            x = torch.randn(32, 256, generator=torch.Generator().manual_seed(step * world + rank))
            model(x).square().mean().backward()
            opt.step()
        parallel = sys.modules.get("numba.np.ufunc.parallel")
        report = {
            "kernel_threads": threads.kernel_threads(),
            "torch_before": torch_before,
            "torch_after": torch.get_num_threads(),
            "pool_started": bool(parallel is not None and parallel._is_initialized),
            "cpus": len(os.sched_getaffinity(0)),
        }
        Path(out, f"rank{rank}-{mode}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def main() -> None:
    launch, out, modes = sys.argv[1:4]
    if launch == "torchrun":
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), out, modes)
        return
    port = rendezvous_port()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    mp.spawn(run, args=(2, out, modes), nprocs=2, join=True)


if __name__ == "__main__":
    main()
