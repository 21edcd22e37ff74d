"""ParallelWrapper overhead: encode + exchange + decode against the training step itself.

Run:  .venv/bin/python bench/parallel.py            (1, 2 and 4 workers; ~1 minute on 2 cores)
      .venv/bin/python bench/parallel.py --workers 2 --rounds 10   (quick)

A 1.07M-parameter MLP (784-1024-256-10) trains on random MNIST-shaped minibatches of 64, for
each worker count, once with threshold-encoded sharing (``AdaptiveThreshold(1e-3)``) and once
sharing exact dense updates (``dense=True``), in one run. Per worker and round it records:

* ``compute``: forward, backward and the local optimizer step (and taking the update out);
* ``encode``: adding into the residual and encoding (dense mode: copying the update);
* ``apply``: decoding every worker's message into a buffer and ``params -= buffer``;
* ``wait``: the rest of the share time, waiting at the round's barrier for slower workers.

``overhead`` is (encode + apply) / compute, the cost gradshare adds to a step on this machine;
``round`` is the wall time per round. Figures are medians over the measured rounds, after
warm-up rounds (kernel compilation, allocator). Results go to bench/results/parallel.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from gradshare import AdaptiveThreshold, ParallelWrapper, StepStats

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _env import environment

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Row:
    workers: int
    mode: str
    numel: int
    round_ms: float
    compute_ms: float
    encode_ms: float
    apply_ms: float
    wait_ms: float
    overhead: float
    bytes_per_round: float
    dense_bytes_per_round: float
    compression_ratio: float


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 256), nn.ReLU(), nn.Linear(256, 10)
    )


def batches(count: int, size: int = 64, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.rand(size, 784, generator=g), torch.randint(0, 10, (size,), generator=g))
        for _ in range(count)
    ]


def measure(workers: int, mode: str, rounds: int, warmup: int) -> Row:
    wrapper = ParallelWrapper(
        model(),
        lambda p: torch.optim.SGD(p, lr=0.01),
        F.cross_entropy,
        num_workers=workers,
        threshold=None if mode == "dense" else AdaptiveThreshold(1e-3),
        dense=mode == "dense",
    )
    acc = wrapper.accumulator
    per_round: list[dict[str, float]] = []
    last = {"t": time.perf_counter(), "encode": [0.0] * workers, "apply": [0.0] * workers}

    def record(stats: list[StepStats]) -> None:
        now = time.perf_counter()
        enc = [a - b for a, b in zip(acc.timings["encode"], last["encode"], strict=True)]
        app = [a - b for a, b in zip(acc.timings["apply"], last["apply"], strict=True)]
        share = [s.share_s for s in stats]
        per_round.append(
            {
                "round": now - last["t"],  # type: ignore[operator]
                "compute": statistics.mean(s.compute_s for s in stats),
                "encode": statistics.mean(enc),
                "apply": statistics.mean(app),
                "wait": statistics.mean(
                    max(0.0, sh - e - a) for sh, e, a in zip(share, enc, app, strict=True)
                ),
                "bytes": sum(s.message_bytes for s in stats),
                "dense": sum(s.dense_bytes for s in stats),
            }
        )
        last.update(t=now, encode=list(acc.timings["encode"]), apply=list(acc.timings["apply"]))

    wrapper.fit(batches((warmup + rounds) * workers), callback=record)
    per_round = per_round[warmup:]
    med = {k: statistics.median(r[k] for r in per_round) for k in per_round[0]}
    return Row(
        workers=workers,
        mode=mode,
        numel=wrapper.numel,
        round_ms=med["round"] * 1e3,
        compute_ms=med["compute"] * 1e3,
        encode_ms=med["encode"] * 1e3,
        apply_ms=med["apply"] * 1e3,
        wait_ms=med["wait"] * 1e3,
        overhead=(med["encode"] + med["apply"]) / med["compute"],
        bytes_per_round=med["bytes"],
        dense_bytes_per_round=med["dense"],
        compression_ratio=med["dense"] / med["bytes"] if med["bytes"] else float("inf"),
    )


def table(rows: list[Row]) -> str:
    head = (
        f"{'workers':>7} {'mode':<8} {'round ms':>9} {'compute':>8} {'encode':>7} {'apply':>7} "
        f"{'wait':>7} {'overhead':>9} {'bytes/round':>12} {'vs dense':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.workers:>7} {r.mode:<8} {r.round_ms:>9.2f} {r.compute_ms:>8.2f} "
            f"{r.encode_ms:>7.3f} {r.apply_ms:>7.3f} {r.wait_ms:>7.2f} {r.overhead:>8.1%} "
            f"{r.bytes_per_round:>12,.0f} {r.compression_ratio:>8.0f}x"
        )
    return "\n".join(lines)


def plot(rows: list[Row], path: Path) -> None:
    """Stacked time per round: compute, encode, apply, wait; dense vs encoded per worker count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = [f"{r.workers}w {r.mode}" for r in rows]
    bottom = [0.0] * len(rows)
    for part in ("compute_ms", "encode_ms", "apply_ms", "wait_ms"):
        values = [getattr(r, part) for r in rows]
        ax.bar(labels, values, bottom=bottom, label=part.removesuffix("_ms"))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set(ylabel="ms per round (per worker)", title="ParallelWrapper: where a round goes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--out", type=Path, default=RESULTS / "parallel.json")
    args = parser.parse_args(argv)
    rows = [
        measure(w, mode, args.rounds, args.warmup)
        for w in args.workers
        for mode in ("dense", "encoded")
    ]
    print(table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"environment": environment(), "rows": [asdict(r) for r in rows]}, indent=1)
    )
    plot(rows, args.out.with_suffix(".png"))
    print(f"\nsaved {args.out} and {args.out.with_suffix('.png')}")
    return rows


if __name__ == "__main__":
    main()
