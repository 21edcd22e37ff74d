"""Accuracy vs bytes on digits: dense DDP, gradshare's hook (4 settings), fp16 and PowerSGD.

Run:  .venv/bin/python bench/convergence.py             (~2 minutes on 2 cores)
      .venv/bin/python bench/convergence.py --epochs 4  (quick)

A world of ``--world`` gloo processes on 127.0.0.1 trains the same MLP (64-256-10, seed 0) on
scikit-learn's digits with DDP and plain SGD, each rank on its share of every epoch's
minibatches, once per gradient exchange:

* ``dense``: DDP's all-reduce;
* ``gradshare adaptive`` / ``fixed`` (from 1e-3 / at 2e-3), each with and without residual
  clipping (5x t, every 5 steps): :func:`gradshare.threshold_hook`; ``--gradshare SPEC``
  adds more settings (``adaptive:T``, ``fixed:T``, ``target:DENSITY``, ``+clip``);
* ``fp16``: PyTorch's ``fp16_compress_hook``; ``powersgd-1``, ``powersgd-4``: PowerSGD at rank 1
  and 4 (error feedback, warm start, compression from the second iteration).

Each method trains once per seed in ``--seeds`` (the seed sets the initial weights and the
shuffling; the test split is fixed), so that differences can be told from noise: one test
image is 0.22 points. It reports the mean and standard deviation of the final test accuracy
over the seeds and the bytes one rank sent in a run (PowerSGD: its P and Q matrices plus
uncompressed vectors, counted from the shapes). Results go to bench/results/convergence.json
and convergence.png.
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
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _env import environment
from exchange import free_port, powersgd_bytes

RESULTS = Path(__file__).resolve().parent / "results"
GRADSHARE = {"gradshare adaptive": "adaptive:1e-3", "gradshare fixed": "fixed:2e-3"}
"""The threshold of each built-in gradshare method (``gradshare train --threshold`` syntax)."""
METHODS = [
    "dense",
    "gradshare adaptive",
    "gradshare adaptive+clip",
    "gradshare fixed",
    "gradshare fixed+clip",
    "fp16",
    "powersgd-1",
    "powersgd-4",
]


@dataclass
class Row:
    method: str
    accuracy: float
    """Mean over the seeds."""
    accuracy_std: float
    accuracies: list[float]
    bytes_sent: int
    """One rank, one run (mean over the seeds)."""
    compression_ratio: float


def _rank(
    rank: int,
    world: int,
    port: int,
    epochs: int,
    lr: float,
    seeds: list[int],
    methods: list[str],
    out: str,
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from gradshare import ResidualClipping, ThresholdHookState, threshold_hook
    from gradshare.app.datasets import digits, minibatches, mlp
    from gradshare.app.train import parse_threshold

    split = digits(seed=0)
    rows = []
    for method, seed in [(m, s) for m in methods for s in seeds]:
        net = mlp(64, 10, hidden=256, seed=seed)
        model = DDP(net, bucket_cap_mb=4096)  # one bucket (see bench/exchange.py)
        state = None
        if method == "fp16":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif method.startswith("powersgd"):
            r = int(method.split("-")[1])
            ps = powerSGD_hook.PowerSGDState(
                None, matrix_approximation_rank=r, start_powerSGD_iter=2
            )
            model.register_comm_hook(ps, powerSGD_hook.powerSGD_hook)
        elif method.startswith("gradshare"):
            name = method.removesuffix("+clip")
            threshold = parse_threshold(GRADSHARE.get(name, name.removeprefix("gradshare ")))
            clip = ResidualClipping(5.0, 5) if method.endswith("+clip") else None
            state = ThresholdHookState(threshold=threshold, post_processor=clip)
            model.register_comm_hook(state, threshold_hook)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        steps = 0
        for epoch in range(epochs):
            batches = minibatches(split.x_train, split.y_train, 32, seed=epoch + 1000 * seed)
            for x, y in batches[: len(batches) // world * world][rank::world]:
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
                steps += 1
        with torch.no_grad():
            accuracy = float((net(split.x_test).argmax(1) == split.y_test).float().mean())
        numel = sum(p.numel() for p in net.parameters())
        per_step = {"dense": 4 * numel, "fp16": 2 * numel}
        if state is not None:
            sent = state.bytes_sent
        elif method.startswith("powersgd"):
            r = int(method.split("-")[1])
            sent = 2 * 4 * numel + (steps - 2) * powersgd_bytes(net, r)  # 2 dense iterations
        else:
            sent = steps * per_step[method]
        rows.append(
            {"method": method, "accuracy": accuracy, "sent": sent, "dense": steps * 4 * numel}
        )
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in rows:
        ax.errorbar(r.bytes_sent, r.accuracy, yerr=r.accuracy_std, fmt="o", capsize=3)
        ax.annotate(
            r.method,
            (r.bytes_sent, r.accuracy),
            fontsize=8,
            xytext=(4, 4),
            textcoords="offset points",
        )
    ax.set_xscale("log")
    ax.set(
        xlabel="bytes sent by one rank, whole run (log)",
        ylabel="test accuracy",
        title="digits MLP: accuracy (mean ± sd over seeds) vs bytes sent",
    )
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--methods",
        nargs="+",
        default=METHODS,
        choices=METHODS,
        metavar="M",
        help="a subset of: " + ", ".join(METHODS),
    )
    parser.add_argument(
        "--gradshare",
        nargs="+",
        default=[],
        metavar="SPEC",
        help="more hook settings, e.g. adaptive:1e-2 target:2e-2",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "convergence.json")
    args = parser.parse_args(argv)
    methods = [*args.methods, *(f"gradshare {spec}" for spec in args.gradshare)]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.json")
        mp.spawn(
            _rank,
            args=(args.world, free_port(), args.epochs, args.lr, args.seeds, methods, out),
            nprocs=args.world,
        )
        runs = json.loads(Path(out).read_text())
    rows = []
    for method in methods:
        mine = [r for r in runs if r["method"] == method]
        accuracies = [r["accuracy"] for r in mine]
        sent = round(statistics.mean(r["sent"] for r in mine))
        mean, sd = statistics.mean(accuracies), statistics.pstdev(accuracies)
        ratio = statistics.mean(r["dense"] for r in mine) / sent
        rows.append(Row(method, mean, sd, accuracies, sent, ratio))
    print(f"{'method':<26} {'accuracy (mean ± sd)':>21} {'bytes sent':>14} {'vs dense':>9}")
    for r in rows:
        print(
            f"{r.method:<26} {r.accuracy:>12.4f} ± {r.accuracy_std:.4f} {r.bytes_sent:>14,} "
            f"{r.compression_ratio:>8.1f}x"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {
        "world": args.world,
        "epochs": args.epochs,
        "lr": args.lr,
        "batch_per_rank": 32,
        "seeds": args.seeds,
        "methods": methods,
    }
    saved = {"environment": environment(), "settings": settings, "rows": [asdict(r) for r in rows]}
    args.out.write_text(json.dumps(saved, indent=1))
    plot(rows, args.out.with_suffix(".png"))
    print(f"\nsaved {args.out} and {args.out.with_suffix('.png')}")
    return rows


if __name__ == "__main__":
    main()
