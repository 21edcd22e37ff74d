"""What ``gradshare train`` leaves behind: metrics.csv, summary.json, report.png, a table."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from gradshare.app.train import RunResult, TrainConfig

__all__ = ["COLUMNS", "compression_text", "summary_table", "write_outputs", "write_tensorboard"]

COLUMNS = [
    "run",
    "epoch",
    "step",
    "worker",
    "loss",
    "threshold",
    "density",
    "message_bytes",
    "dense_bytes",
    "format",
    "residual_norm",
    "clipped",
]


def compression_text(dense_bytes: int, sent_bytes: int) -> str:
    """Dense bytes / sent bytes as ``"12.3x"``, or ``"nothing sent"`` (no ratio) for 0 sent."""
    return f"{dense_bytes / sent_bytes:.1f}x" if sent_bytes else "nothing sent"


def summary_table(results: list[RunResult]) -> str:
    head = (
        f"{'run':<12} {'accuracy':>9} {'time s':>8} {'bytes sent':>14} {'dense bytes':>14} "
        f"{'compression':>12}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r.name:<12} {r.accuracy:>9.4f} {r.seconds:>8.1f} {r.bytes_sent:>14,} "
            f"{r.dense_bytes:>14,} {compression_text(r.dense_bytes, r.bytes_sent):>12}"
        )
    return "\n".join(lines)


def write_outputs(out: Path, config: TrainConfig, results: list[RunResult]) -> list[Path]:
    """Write metrics.csv, summary.json and report.png into ``out``; return their paths."""
    out.mkdir(parents=True, exist_ok=True)
    metrics = out / "metrics.csv"
    with metrics.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for r in results:
            writer.writerows(r.rows)
    summary = out / "summary.json"
    doc: dict[str, Any] = {
        "config": {k: getattr(config, k) for k in config.__slots__},
        "runs": {r.name: {**r.summary(), "epochs": r.epochs} for r in results},
    }
    summary.write_text(json.dumps(doc, indent=1, default=list))
    report = out / "report.png"
    plot(results, report)
    return [metrics, summary, report]


def _per_step(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """Mean of ``key`` over the workers of each step."""
    by_step: dict[int, list[float]] = {}
    for r in rows:
        if r[key] is not None:
            by_step.setdefault(r["step"], []).append(float(r[key]))
    steps = sorted(by_step)
    return steps, [sum(by_step[s]) / len(by_step[s]) for s in steps]


def plot(results: list[RunResult], path: Path) -> None:
    """Loss and accuracy of every run, gradshare's threshold and density, cumulative bytes (the
    local-steps run's syncs marked on its bytes and, as faint lines, on the loss)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    (loss_ax, acc_ax), (thr_ax, bytes_ax) = axes
    for r in results:
        steps, loss = _per_step(r.rows, "loss")
        loss_ax.plot(steps, loss, label=r.name, lw=1)
        acc_ax.plot(
            [e["epoch"] + 1 for e in r.epochs],
            [e["accuracy"] for e in r.epochs],
            marker="o",
            label=r.name,
        )
        ordered = sorted(r.rows, key=lambda x: x["step"])
        cumulative, total, seen = [], 0, []
        for row in ordered:
            total += row["message_bytes"]
            seen.append(row["step"])
            cumulative.append(total)
        line = bytes_ax.plot(seen, cumulative, label=r.name)[0]
        syncs = [i for i, row in enumerate(ordered) if row.get("format") == "sync"]
        if syncs:  # local steps: a mark at every sync, on the loss curve too
            marks = ([seen[i] for i in syncs], [cumulative[i] for i in syncs])
            bytes_ax.plot(
                *marks, "|", color=line.get_color(), markersize=9, label=f"{r.name} syncs"
            )
            sync_steps = sorted({seen[i] for i in syncs})
            for s in sync_steps:
                loss_ax.axvline(s, color=line.get_color(), lw=0.3, alpha=0.4)
        if any(row["threshold"] is not None for row in r.rows):
            steps, thr = _per_step(r.rows, "threshold")
            thr_ax.plot(steps, thr, color="tab:orange", label=f"{r.name} threshold")
            dens_ax = thr_ax.twinx()
            steps, dens = _per_step(r.rows, "density")
            dens_ax.plot(steps, dens, color="tab:green", lw=0.8, label=f"{r.name} density")
            dens_ax.set_yscale("log")
            dens_ax.set_ylabel("density (kept fraction)", color="tab:green")
    loss_ax.set(title="training loss (mean over workers)", xlabel="step", ylabel="loss")
    acc_ax.set(title="test accuracy", xlabel="epoch", ylabel="accuracy")
    thr_ax.set(title="gradshare: threshold and density", xlabel="step")
    thr_ax.set_ylabel("threshold", color="tab:orange")
    thr_ax.set_yscale("log")
    bytes_ax.set(title="bytes sent, cumulative (all workers)", xlabel="step", ylabel="bytes")
    bytes_ax.set_yscale("log")
    for ax in (loss_ax, acc_ax, bytes_ax):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_tensorboard(out: Path, results: list[RunResult]) -> None:
    """Scalars per step (mean over workers) and per epoch, one TensorBoard run per result."""
    from torch.utils.tensorboard import SummaryWriter

    for r in results:
        with SummaryWriter(str(out / "tensorboard" / r.name)) as w:
            for key in ("loss", "threshold", "density", "message_bytes", "residual_norm"):
                for step, value in zip(*_per_step(r.rows, key), strict=True):
                    w.add_scalar(f"train/{key}", value, step)
            for e in r.epochs:
                w.add_scalar("test/accuracy", e["accuracy"], e["epoch"])
                w.add_scalar("test/loss", e["loss"], e["epoch"])
