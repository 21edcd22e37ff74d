"""Exchange cost per step: gradshare's hook vs dense all-reduce, fp16 and PowerSGD, over gloo.

Run:  .venv/bin/python bench/exchange.py                 (~8 minutes on 2 cores, as root)
      .venv/bin/python bench/exchange.py --worlds 2 --rates none --steps 3   (quick)

One run measures, for each world size and each link rate, a DDP model of five square Linear
layers (25M parameters by default; its gradient is the "flat update") whose gradients are
exchanged by:

* ``dense``: DDP's own all-reduce (float32);
* ``fp16``: PyTorch's ``fp16_compress_hook``;
* ``powersgd-1``, ``powersgd-4``: PyTorch's PowerSGD hook at rank 1 and 4 (error feedback,
  warm start);
* ``gradshare``: :func:`gradshare.threshold_hook` (adaptive threshold starting from the 99.9th
  percentile of the first gradient, and 40 warm-up steps so that it settles: with error
  feedback the residual grows, and the threshold follows it);

and ``compute``: the same forward and backward with no exchange at all (measured first and
last; the faster is kept, so that a slow moment of the machine cannot shrink ``exchange ms``).
``ms/step`` is the median over the timed steps of the slowest rank (the inputs cycle through
4 random batches, so gradients change from step to step and the residual sums them);
``bytes/step`` is what one rank contributes per step (its message, or its share of the
payload). DDP runs with one bucket for every method (``bucket_cap_mb=4096``): PowerSGD's
chained collectives can otherwise be issued in different orders on different ranks over
gloo, which aborts the run; and with
``gradient_as_bucket_view=True`` for every method (gradients live in the bucket, which saves
DDP two copies of every gradient per step, as PyTorch recommends for communication hooks).
``exchange ms`` is ``ms/step`` minus ``compute``: what the method adds to a step.

Link rates: ``none`` is plain loopback. ``1gbit``, ``100mbit`` run the whole world inside a
network namespace that this script creates, whose loopback is shaped with ``tc ... tbf``; all
ranks share that one limit (so it is the aggregate rate, harsher than one link per host). The
namespace is removed afterwards. Needs root; skipped with a message otherwise. At 100mbit only
the smallest world is run (dense steps take tens of seconds there).

The cost model at the end: per rank and step, ring all-reduce sends 2(W-1)/W · 4N bytes while
an all-gather of W messages of m bytes sends (W-1) · m, so sparse all-gather wins while
W < 2 · 4N / m, i.e. W < 2 / density for sparse messages and W < 8 for bitmaps.
Results go to bench/results/exchange.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numba
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _env import environment

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = [
    m
    for m in os.environ.get(
        "GS_METHODS", "compute dense fp16 powersgd-1 powersgd-4 gradshare"
    ).split()
]
LAYERS = 5
WARMUP = 40
"""Steps gradshare runs before timing, so that its adaptive threshold has settled."""
RATES = ["none", "1gbit", "100mbit"]


@dataclass
class Row:
    rate: str
    world: int
    method: str
    numel: int
    ms_per_step: float
    bytes_per_step: float
    density: float | None
    speedup_vs_dense: float | None = None
    """Dense ms/step over this method's."""
    exchange_ms: float | None = None
    """ms/step minus compute's: what the exchange adds to a step."""
    exchange_speedup_vs_dense: float | None = None
    """Dense exchange ms over this method's."""


def model(numel: int) -> nn.Module:
    dim = int(math.sqrt(numel / LAYERS))
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(dim, dim) for _ in range(LAYERS)])


def powersgd_bytes(m: nn.Module, rank: int) -> int:
    """Bytes PowerSGD all-reduces per step: P and Q for matrices, 1-D tensors uncompressed."""
    total = 0
    for p in m.parameters():
        if p.dim() >= 2:
            n, k = p.shape[0], p[0].numel()
            total += 4 * (n + k) * min(rank, n, k)
        else:
            total += 4 * p.numel()
    return total


def _rank(rank: int, world: int, port: int, numel: int, steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # the ranks share the machine's cores: one thread each,
    numba.set_num_threads(1)  # for torch and for gradshare's kernels alike
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from gradshare import AdaptiveThreshold, ThresholdHookState, threshold_hook

    rows = []
    for method in [*METHODS, "compute"] if "compute" in METHODS else METHODS:
        net = model(numel)
        g = torch.Generator().manual_seed(rank)
        xs = [torch.randn(8, net[0].in_features, generator=g) for _ in range(4)]
        x = xs[0]
        t = 0.0
        if method == "gradshare":  # start the threshold near the 99.9th percentile
            net(x).square().mean().backward()
            g = torch.cat([p.grad.reshape(-1) for p in net.parameters()]).abs()
            t = float(torch.quantile(g[:: max(1, g.numel() // 1_000_000)], 0.999))
            net.zero_grad()
        run: nn.Module = (
            net
            if method == "compute"
            else DDP(net, bucket_cap_mb=4096, gradient_as_bucket_view=True)
        )
        state = None
        warmup = {"gradshare": WARMUP, "powersgd-1": 3, "powersgd-4": 3}.get(method, 2)
        if method == "fp16":
            run.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif method.startswith("powersgd"):
            r = int(method.split("-")[1])
            ps = powerSGD_hook.PowerSGDState(
                None, matrix_approximation_rank=r, start_powerSGD_iter=2
            )
            run.register_comm_hook(ps, powerSGD_hook.powerSGD_hook)
        elif method == "gradshare":
            state = ThresholdHookState(threshold=AdaptiveThreshold(t))
            run.register_comm_hook(state, threshold_hook)
        times, sent0 = [], 0
        for i in range(warmup + steps):
            if i == warmup and state is not None:
                sent0 = state.bytes_sent
            dist.barrier()
            start = time.perf_counter()
            run.zero_grad(set_to_none=False)
            run(xs[i % len(xs)]).square().mean().backward()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i >= warmup:
                times.append(float(elapsed))
        n = sum(p.numel() for p in net.parameters())
        density = None
        if method == "compute":
            sent = 0.0
        elif method == "dense":
            sent = 4.0 * n
        elif method == "fp16":
            sent = 2.0 * n
        elif method.startswith("powersgd"):
            sent = float(powersgd_bytes(net, int(method.split("-")[1])))
        else:
            assert state is not None
            sent = (state.bytes_sent - sent0) / steps
            words = sent / 4 - 4 * len(state.encoders)  # sparse: entries plus a header each
            density = words / n  # mean over the timed steps
        rows.append({"method": method, "numel": n, "ms": statistics.median(times) * 1e3,
                     "bytes": sent, "density": density})  # fmt: skip
        del run, net
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def inner(world: int, numel: int, steps: int) -> list[dict]:
    """Run every method on a world of ``world`` processes here (in whatever namespace)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.json")
        mp.spawn(_rank, args=(world, free_port(), numel, steps, out), nprocs=world, join=True)
        rows = json.loads(Path(out).read_text())
    compute = [r for r in rows if r["method"] == "compute"]
    if compute:  # measured first and last: keep the faster, the floor of a step
        rows = [r for r in rows if r["method"] != "compute"]
        rows.insert(0, min(compute, key=lambda r: r["ms"]))
    return rows


@contextlib.contextmanager
def shaped_namespace(rate: str) -> Iterator[str]:
    """A fresh network namespace whose loopback is limited to ``rate``; removed on exit."""
    name = f"gradshare-bench-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    try:
        ns = ["ip", "netns", "exec", name]
        subprocess.run([*ns, "ip", "link", "set", "lo", "up"], check=True, capture_output=True)
        subprocess.run(
            [*ns, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate,
             "burst", "1mb", "latency", "100ms"],
            check=True, capture_output=True,
        )  # fmt: skip
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def measure(rate: str, world: int, numel: int, steps: int) -> list[Row]:
    if rate == "none":
        raw = inner(world, numel, steps)
    else:
        with shaped_namespace(rate) as ns, tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "rows.json"
            cmd = ["ip", "netns", "exec", ns, sys.executable, __file__, "--inner", str(world),
                   "--numel", str(numel), "--steps", str(steps), "--out", str(out)]  # fmt: skip
            subprocess.run(cmd, check=True, timeout=1800)
            raw = json.loads(out.read_text())
    dense_ms = next(r["ms"] for r in raw if r["method"] == "dense")
    compute_ms = next((r["ms"] for r in raw if r["method"] == "compute"), None)
    rows = []
    for r in raw:
        row = Row(rate, world, r["method"], r["numel"], r["ms"], r["bytes"], r["density"])
        if r["method"] != "compute":
            row.speedup_vs_dense = dense_ms / r["ms"]
            if compute_ms is not None:
                row.exchange_ms = max(r["ms"] - compute_ms, 1e-3)
                row.exchange_speedup_vs_dense = (dense_ms - compute_ms) / row.exchange_ms
        rows.append(row)
    return rows


def can_shape() -> str | None:
    """None if namespaces with tc shaping can be made here, else why not."""
    if os.geteuid() != 0:
        return "not root"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "`ip` or `tc` missing"
    return None


def table(rows: list[Row]) -> str:
    head = (
        f"{'rate':<8} {'world':>5} {'method':<11} {'ms/step':>9} {'bytes/step':>14} "
        f"{'density':>8} {'vs dense':>9} {'exchange ms':>12} {'vs dense':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        density = f"{r.density:.1e}" if r.density is not None else "-"
        speed = f"{r.speedup_vs_dense:.1f}x" if r.speedup_vs_dense is not None else "-"
        exchange = f"{r.exchange_ms:.1f}" if r.exchange_ms is not None else "-"
        ex_speed = (
            f"{r.exchange_speedup_vs_dense:.1f}x"
            if r.exchange_speedup_vs_dense is not None
            else "-"
        )
        lines.append(
            f"{r.rate:<8} {r.world:>5} {r.method:<11} {r.ms_per_step:>9.1f} "
            f"{r.bytes_per_step:>14,.0f} {density:>8} {speed:>9} {exchange:>12} {ex_speed:>9}"
        )
    return "\n".join(lines)


def cost_model(numel: int, density: float) -> list[dict[str, float]]:
    """Bytes each rank sends per step: ring all-reduce (dense) vs all-gather of messages."""
    dense = 4.0 * numel
    sparse = 4.0 * (density * numel + 4)
    bitmap = 4.0 * (numel // 16 + 5)
    out = []
    for w in (2, 4, 8, 16, 64, 256, 1024, 4096):
        out.append(
            {
                "world": w,
                "allreduce_dense": 2 * (w - 1) / w * dense,
                "allgather_sparse": (w - 1) * sparse,
                "allgather_bitmap": (w - 1) * bitmap,
            }
        )
    return out


def plot(rows: list[Row], path: Path) -> None:
    """ms per step of every method, one group per (rate, world), log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r.rate, r.world) for r in rows}, key=lambda g: (RATES.index(g[0]), g[1]))
    methods = [m for m in METHODS if any(r.method == m for r in rows)]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / max(len(methods), 1)
    for k, m in enumerate(methods):
        xs, ys = [], []
        for g, (rate, world) in enumerate(groups):
            hit = [r for r in rows if (r.rate, r.world, r.method) == (rate, world, m)]
            if hit:
                xs.append(g + k * width)
                ys.append(hit[0].ms_per_step)
        ax.bar(xs, ys, width, label=m)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
    ax.set_xticklabels([f"{rate}, {world} ranks" for rate, world in groups])
    ax.set_yscale("log")
    ax.set(ylabel="ms per step (log)", title="gradient exchange per step, 25M parameters")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rates", nargs="+", default=RATES, choices=RATES)
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS / "exchange.json")
    parser.add_argument("--inner", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inner is not None:  # inside a shaped namespace
        args.out.write_text(json.dumps(inner(args.inner, args.numel, args.steps)))
        return
    rows: list[Row] = []
    skipped = []
    for rate in args.rates:
        why = None if rate == "none" else can_shape()
        if why:
            skipped.append(f"{rate}: skipped ({why})")
            print(f"rate {rate}: skipped, {why}")
            continue
        worlds = args.worlds[:1] if rate == "100mbit" else args.worlds
        for world in worlds:
            steps = min(args.steps, 2) if rate == "100mbit" else args.steps
            print(f"rate {rate}, world {world} ...", flush=True)
            rows += measure(rate, world, args.numel, steps)
    print(table(rows))
    densities = [r.density for r in rows if r.density]
    density = statistics.median(densities) if densities else 1e-3
    model_rows = cost_model(args.numel, density)
    print(
        f"\ncost model, N = {args.numel:,}, sparse density {density:.1e} (bytes per rank per step)"
    )
    print(
        f"{'world':>6} {'all-reduce dense':>17} {'all-gather sparse':>18} {'all-gather bitmap':>18}"
    )
    for m in model_rows:
        print(
            f"{m['world']:>6} {m['allreduce_dense']:>17,.0f} {m['allgather_sparse']:>18,.0f} "
            f"{m['allgather_bitmap']:>18,.0f}"
        )
    crossover = 2 / density
    print(f"sparse all-gather beats dense all-reduce while world < 2/density = {crossover:,.0f}; "
          "bitmaps (2 bits/element) only while world < 8")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "environment": environment(),
                "rows": [asdict(r) for r in rows],
                "skipped": skipped,
                "cost_model": {
                    "density": density,
                    "crossover_world": crossover,
                    "rows": model_rows,
                },
            },
            indent=1,
        )
    )
    plot(rows, args.out.with_suffix(".png"))
    print(f"\nsaved {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
