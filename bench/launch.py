"""Step time where users launch it: 2 ranks, no thread variables, a small GPT with AdamW.

Run:  .venv/bin/python bench/launch.py                  (~3 minutes on 2 cores)
      .venv/bin/python bench/launch.py --steps 20       (quick)

The character-level GPT of the quality workloads (token and position embeddings, 2 blocks of
``nn.MultiheadAttention`` and a 4x MLP, 128 wide: 0.43M parameters in 30 tensors) trains on
CPython's documentation text, 16 windows of 64 characters per rank, with AdamW (lr 1e-3,
betas 0.9/0.95, weight decay 0.1) and ``clip_grad_norm_(..., 1.0)``, on 2 gloo ranks on
127.0.0.1, launched the two ways PyTorch documents, with no thread variable set by us:

* ``mp.spawn``: ``torch.multiprocessing.spawn`` as in PyTorch's DDP tutorial (it sets no
  thread variable: torch takes every core in each rank);
* ``torchrun``: ``torchrun --standalone --nproc_per_node=2`` (it sets ``OMP_NUM_THREADS=1``).

In each launch, the same processes train with, one after the other:

* ``dense``: plain DDP (its own all-reduce, default buckets);
* ``hook``: ``gradshare.register_threshold_hook(ddp_model)`` with its defaults;
* ``shared``: ``gradshare.SharedOptimizer(adamw)`` with its defaults (no DDP).

``ms/step`` is the median over the timed steps of the slowest rank (forward, backward,
clipping, the optimizer step and the exchange), after warm-up steps; ``vs dense`` is the
method's step over dense's, taken in the same run. Results go to bench/results/launch.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _env import environment, free_port
from _models import adamw, gpt, lm_loss, text, text_batch, vocab_size

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ("dense", "hook", "shared")
TUNING = ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "MKL_NUM_THREADS", "GRADSHARE_NUM_THREADS")


@dataclass
class Row:
    launch: str
    method: str
    ms_per_step: float
    vs_dense: float
    torch_threads: int
    kernel_threads: int | None
    """Threads of gradshare's kernels (None for dense, which runs none)."""
    bytes_per_step: float


def _train(rank: int, world: int, steps: int, warmup: int, out: str) -> None:
    import gradshare
    from gradshare.codec import threads

    ids = text()
    rows = []
    for method in METHODS:
        model = gpt("gpt-0.45m", vocab_size(ids))
        net = DDP(model) if method != "shared" else model
        opt = adamw(list(model.parameters()))
        state = None
        if method == "hook":
            state = gradshare.register_threshold_hook(net)
        elif method == "shared":
            opt = gradshare.SharedOptimizer(opt)
        g = torch.Generator().manual_seed(1000 * rank)
        times = []
        for i in range(warmup + steps):
            x, y = text_batch(ids, 16, 64, g)
            dist.barrier()
            start = time.perf_counter()
            opt.zero_grad()
            lm_loss(net(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i >= warmup:
                times.append(float(elapsed))
        numel = sum(p.numel() for p in model.parameters())
        if state is not None:
            sent = state.bytes_sent / (warmup + steps)
        elif method == "shared":
            sent = opt.bytes_sent / (warmup + steps)  # type: ignore[attr-defined]
        else:
            sent = 4.0 * numel
        kernel = None if method == "dense" else threads.kernel_threads()
        rows.append(
            {
                "method": method,
                "ms": statistics.median(times) * 1e3,
                "bytes": sent,
                "torch_threads": torch.get_num_threads(),
                "kernel_threads": kernel,
            }
        )
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _spawned(rank: int, world: int, port: int, steps: int, warmup: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    _train(rank, world, steps, warmup, out)


def run_launch(launch: str, steps: int, warmup: int) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in TUNING}
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.json")
        flags = ["--inner", launch, "--steps", str(steps), "--warmup", str(warmup), "--out", out]
        common = [str(Path(__file__).resolve()), *flags]
        if launch == "torchrun":
            torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
            cmd = [sys.executable, *torchrun, *common]
        else:
            cmd = [sys.executable, *common]
        subprocess.run(cmd, check=True, env=env, timeout=1800)
        return json.loads(Path(out).read_text())


def table(rows: list[Row]) -> str:
    head = (
        f"{'launch':<9} {'method':<7} {'ms/step':>8} {'vs dense':>9} {'torch thr':>10} "
        f"{'kernel thr':>11} {'bytes/step':>12}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.launch:<9} {r.method:<7} {r.ms_per_step:>8.1f} {r.vs_dense:>8.2f}x "
            f"{r.torch_threads:>10} {r.kernel_threads or '-':>11} {r.bytes_per_step:>12,.0f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--launches", nargs="+", default=["mp.spawn", "torchrun"], choices=["mp.spawn", "torchrun"]
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--out", type=Path, default=RESULTS / "launch.json")
    parser.add_argument("--inner", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inner == "torchrun":  # a rank started by torchrun
        dist.init_process_group("gloo")
        _train(dist.get_rank(), dist.get_world_size(), args.steps, args.warmup, str(args.out))
        return []
    if args.inner == "mp.spawn":  # the parent of mp.spawn's ranks
        mp.spawn(
            _spawned,
            args=(2, free_port(), args.steps, args.warmup, str(args.out)),
            nprocs=2,
            join=True,
        )
        return []
    rows: list[Row] = []
    for launch in args.launches:
        print(f"launch {launch} ...", flush=True)
        raw = run_launch(launch, args.steps, args.warmup)
        dense = next(r["ms"] for r in raw if r["method"] == "dense")
        for r in raw:
            counts = (r["torch_threads"], r["kernel_threads"])
            rows.append(Row(launch, r["method"], r["ms"], r["ms"] / dense, *counts, r["bytes"]))
    print(table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"environment": environment(), "rows": [asdict(r) for r in rows]}, indent=1)
    )
    print(f"\nsaved {args.out}")
    return rows


if __name__ == "__main__":
    main()
