"""Quality per byte on a real workload: the character-level GPT with AdamW and clipping.

Run:  .venv/bin/python bench/workloads.py                 (~4 minutes on 2 cores)
      .venv/bin/python bench/workloads.py --steps 100 --seeds 0

The first of the quality workloads: the 0.43M-parameter GPT of ``bench/_models.py`` (2 blocks
of 128) on CPython's documentation text (the last 10% held out for validation), AdamW (lr 1e-3,
betas 0.9/0.95, weight decay 0.1 on matrices only), ``clip_grad_norm_(..., 1.0)``, 2 gloo
ranks, 16 windows of 64 characters per rank and step. Each method trains the same model from
the same seed on the same batches:

* ``dense``: plain DDP;
* ``powersgd-1``, ``powersgd-4``: PyTorch's PowerSGD hook (one bucket);
* ``hook``: ``gradshare.register_threshold_hook(ddp)``, defaults;
* ``hook-1%``: the same with ``threshold=gradshare.QuantileThreshold(0.01)``;
* ``shared``: ``gradshare.SharedOptimizer(adamw)``, defaults (AdamW's updates are shared);
* ``shared-1%``: the same with ``QuantileThreshold(0.01)``.

It reports the validation loss after ``--steps`` steps (mean ± sd over seeds) and the bytes one
rank sent. Results go to bench/results/workloads.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _env import environment, free_port
from _models import adamw, gpt, lm_loss, powersgd_bytes, text, text_batch, vocab_size

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ["dense", "powersgd-1", "powersgd-4", "hook", "hook-1%", "shared", "shared-1%"]


@dataclass
class Row:
    method: str
    loss_mean: float
    loss_sd: float
    bytes_per_rank: float
    fewer_bytes_than_dense: float
    seeds: int


@torch.no_grad()
def validation_loss(model: torch.nn.Module, ids: torch.Tensor) -> float:
    model.eval()
    g = torch.Generator().manual_seed(12345)
    losses = [float(lm_loss(model(x), y)) for x, y in
              (text_batch(ids, 32, 64, g) for _ in range(8))]  # fmt: skip
    model.train()
    return statistics.mean(losses)


def _run(method: str, rank: int, world: int, seed: int, steps: int, ids: torch.Tensor) -> dict:
    import gradshare

    split = int(ids.numel() * 0.9)
    train, val = ids[:split], ids[split:]
    model = gpt("gpt-0.45m", vocab_size(ids), seed=seed)
    opt = adamw(list(model.parameters()))
    net: torch.nn.Module = model
    state = None
    if method in ("dense", "hook", "hook-1%"):
        net = DDP(model)
    elif method.startswith("powersgd"):
        net = DDP(model, bucket_cap_mb=4096)
        net.register_comm_hook(
            powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=int(method[-1]),
                                        start_powerSGD_iter=2),
            powerSGD_hook.powerSGD_hook,
        )  # fmt: skip
    if method == "hook":
        state = gradshare.register_threshold_hook(net)  # type: ignore[arg-type]
    elif method == "hook-1%":
        state = gradshare.register_threshold_hook(
            net,
            threshold=gradshare.QuantileThreshold(0.01),  # type: ignore[arg-type]
        )
    elif method == "shared":
        opt = gradshare.SharedOptimizer(opt)
    elif method == "shared-1%":
        opt = gradshare.SharedOptimizer(opt, threshold=gradshare.QuantileThreshold(0.01))
    g = torch.Generator().manual_seed(1000 * seed + rank)
    for _ in range(steps):
        x, y = text_batch(train, 16, 64, g)
        opt.zero_grad()
        lm_loss(net(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    numel = sum(p.numel() for p in model.parameters())
    if state is not None:
        sent = float(state.bytes_sent)
    elif method.startswith("shared"):
        sent = float(opt.bytes_sent)  # type: ignore[attr-defined]
    elif method.startswith("powersgd"):
        sent = 2 * 4.0 * numel + (steps - 2) * powersgd_bytes(model, int(method[-1]))
    else:
        sent = 4.0 * numel * steps
    return {"method": method, "seed": seed, "loss": validation_loss(model, val), "bytes": sent,
            "dense": 4.0 * numel * steps}  # fmt: skip


def _rank(rank: int, world: int, port: int, methods: list[str], seeds: list[int], steps: int,
          out: str) -> None:  # fmt: skip
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ids = text()
    rows = [_run(m, rank, world, s, steps, ids) for s in seeds for m in methods]
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=RESULTS / "workloads.json")
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"  # as torchrun sets it for several ranks per host
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.json")
        mp.spawn(_rank, args=(2, port, args.methods, args.seeds, args.steps, out), nprocs=2,
                 join=True)  # fmt: skip
        raw = json.loads(Path(out).read_text())
    rows = []
    for m in args.methods:
        mine = [r for r in raw if r["method"] == m]
        losses = [r["loss"] for r in mine]
        sent = statistics.mean(r["bytes"] for r in mine)
        rows.append(Row(m, statistics.mean(losses),
                        statistics.stdev(losses) if len(losses) > 1 else 0.0, sent,
                        mine[0]["dense"] / sent, len(mine)))  # fmt: skip
    print(f"GPT 0.43M, AdamW + clipping, 2 ranks, {args.steps} steps, seeds {args.seeds}")
    print(f"{'method':<11} {'val loss (mean ± sd)':>21} {'bytes/rank':>13} {'fewer bytes':>12}")
    for r in rows:
        print(f"{r.method:<11} {r.loss_mean:>12.3f} ± {r.loss_sd:.3f} {r.bytes_per_rank:>13,.0f} "
              f"{r.fewer_bytes_than_dense:>11.0f}x")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"environment": environment(), "steps": args.steps,
                                    "seeds": args.seeds, "rows": [asdict(r) for r in rows],
                                    "runs": raw}, indent=1))  # fmt: skip
    print(f"\nsaved {args.out}")
    return rows


if __name__ == "__main__":
    main()
