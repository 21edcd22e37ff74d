"""One rank of a job whose peer hangs: the README's plain ``init_process_group("gloo")``
(gloo's own timeout, 30 minutes), a SharedOptimizer with a short timeout. Rank 0 gets the
ExchangeError, prints it, and leaves the normal way; the test times how long it takes to exit.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/fault_exit.py {shared,hook}
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradshare


def job(mode: str, timeout: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small model with the DDP hook (``mode`` "hook") or a SharedOptimizer ("shared")."""
    model = nn.Linear(64, 64)
    if mode == "hook":
        net = DDP(model)
        gradshare.register_threshold_hook(net, timeout=timeout, start_iter=0)
        return net, torch.optim.SGD(model.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, gradshare.SharedOptimizer(opt, timeout=timeout)


def step(net: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    net(torch.randn(8, 64)).square().mean().backward()
    opt.step()


def main() -> None:
    mode = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    net, opt = job(mode, timeout=2)
    print("ready", flush=True)
    if rank == 1:
        time.sleep(600)  # the peer that hangs
    try:
        step(net, opt)
    except Exception as e:
        print(f"raised {type(e).__name__}: {str(e)[:200]}", flush=True)
    print(f"leaving {time.monotonic():.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
