"""Step time with each exchange on a 25M-parameter GPT and square layers, over gloo links.

Run:  .venv/bin/python bench/exchange.py                  (~40 minutes on 2 cores, as root)
      .venv/bin/python bench/exchange.py --models gpt --worlds 2 --rates none --steps 3

Each world is started with ``torch.multiprocessing.spawn`` and ``OMP_NUM_THREADS=1``, as
torchrun sets it for several ranks per host (gradshare then sets nothing: its kernels follow
torch's count). Without it, on these 2 cores, every rank's torch takes both cores and DDP's
dense all-reduce of the GPT slows from 0.46 s to 3.1 s a step (measured), which would flatter
every other method; ``bench/launch.py`` measures that launch on its own. Each method runs
with the settings a user gets by default:

* ``dense``: DDP's own all-reduce, DDP's default buckets (25 MB);
* ``fp16``: PyTorch's ``fp16_compress_hook`` (default buckets);
* ``powersgd-1``, ``powersgd-4``: PyTorch's PowerSGD hook at rank 1 and 4 (error feedback,
  warm start, ``start_powerSGD_iter=2``), in one bucket: with several buckets its chained
  collectives can be issued in different orders on different gloo ranks, which aborts;
* ``hook``: ``gradshare.register_threshold_hook(ddp_model)`` with its defaults (default
  buckets; the exchange overlaps with backward);
* ``hook-1%``: the same hook with ``threshold=gradshare.QuantileThreshold(0.01)``: t set each
  step so that about 1% of the elements go out (about PowerSGD-4's bytes on this GPT);
* ``shared``: ``gradshare.SharedOptimizer(adamw)`` with its defaults (no DDP);
* ``local``, ``local-overlap``, ``local-overlap{τ}``: ``gradshare.LocalSteps(model, adamw,
  sync_every=10)`` with its defaults, with ``overlap=True`` (merged at the next sync) and
  with ``overlap=τ`` (merged τ steps after its sync; τ 1, 2 or 5), ``local-f5-overlap{τ}``
  with ``fragments=5`` too (each fifth of the model synced in turn), ``local-d2-f5-overlap2``
  with ``density=0.02`` too, ``-c`` after any of them with ``compact=True``,
  ``local-h30-f5-overlap2[-c]`` with ``sync_every=30`` (no DDP); timed over whole rounds of
  ``sync_every`` steps, each ending with its sync, after one untimed round;
  ``ms/step`` is their mean, not the median;

and ``compute``: the same forward, backward and optimizer step with no exchange at all
(measured first and last; the faster is kept, so a slow moment cannot shrink ``exchange``;
with ``--paired`` also between every two methods, and each method is compared with the mean
of the compute runs just before and after it: the step time of these processes drifts by up
to 20 % over a run on this VM, so only neighbours are comparable).
Every method steps AdamW. Models: ``gpt``, the character-level GPT of the quality workloads
scaled to 8 blocks of 512 (25.4M parameters in 102 tensors), 2 windows of 64 characters of
CPython's documentation per rank; ``square``, five square Linear layers (25M parameters), 8
random rows per rank.

Warm-up before timing: 2 steps for dense and fp16, 3 for PowerSGD (its start), 10 for
gradshare (what any run passes through in its first seconds; the default adaptive threshold
starts at 1e-3 and keeps adapting; for the local methods, their first round). Then up to
``--steps`` timed steps (the local methods: whole rounds, at least 2), at most 60 s per
method (at least 2 steps). ``ms/step`` is the median over the timed steps of the slowest
rank; ``exchange`` is ``ms/step`` minus ``compute`` and ``share`` its fraction of the step;
``bytes/step`` is what one rank contributes per step (its messages, or its share of the
payload), and gradshare's density is taken from those bytes. For the local methods, ``in
sync`` is the ms per step that the training loop spent inside LocalSteps' syncs and merges
(rank 0's ``sync_seconds`` over the timed steps) and ``waits`` the part of it spent waiting
for an exchange in flight (``wait_seconds``): measured within the run, so unlike
``exchange`` they do not depend on the compute-only baseline.

Link rates: ``none`` is plain loopback. ``1gbit``, ``100mbit`` run the whole world inside a
network namespace that this script creates, whose loopback is shaped with ``tc ... tbf``; all
ranks share that one limit (so it is the aggregate rate, harsher than one link per host). The
namespace is removed afterwards. Needs root; skipped with a message otherwise. At 100mbit only
the smallest world is run (dense steps take tens of seconds there).

The cost model at the end: per rank and step, ring all-reduce sends 2(W-1)/W · 4N bytes while
an all-gather of W messages of m bytes sends (W-1) · m, so sparse all-gather wins while
W < 2 · 4N / m, i.e. W < 2 / density for sparse messages and W < 8 for bitmaps.
Results go to bench/results/exchange.json and exchange.png.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _env import environment, free_port, timed_steps
from _models import gpt, lm_loss, powersgd_bytes, text, text_batch, vocab_size

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = [
    "compute",
    "dense",
    "fp16",
    "powersgd-1",
    "powersgd-4",
    "hook",
    "hook-1%",
    "shared",
    "local",
    "local-overlap",
    "local-overlap1",
    "local-overlap2",
    "local-overlap5",
    "local-f5-overlap2",
    "local-f5-overlap1",
    "local-d2-f5-overlap2",
    "local-c",
    "local-f5-overlap2-c",
    "local-f5-overlap1-c",
    "local-h30-f5-overlap2",
    "local-h30-f5-overlap2-c",
]
LOCAL_METHOD = re.compile(
    r"^local(-h(?P<h>\d+))?(-d(?P<pct>[\d.]+))?(-f(?P<frags>\d+))?(-overlap(?P<tau>\d+)?)?"
    r"(?P<compact>-c)?$"
)
"""``local[-h{H}][-d{pct}][-f{p}][-overlap[τ]][-c]``: sync_every H (default
:data:`LOCAL_H`), density pct %, p fragments, overlap τ (True bare), compact messages."""
LOCAL_H = 10
"""``sync_every`` of the ``local`` methods without ``-h``."""
MODELS = ["gpt", "square"]
LAYERS = 5
WARMUP = {
    "dense": 2,
    "fp16": 2,
    "powersgd-1": 3,
    "powersgd-4": 3,
    "hook": 10,
    "hook-1%": 10,
    "shared": 10,
    "compute": 2,
}
BUDGET_S = 60.0
"""Most seconds of timed steps per method (at least 2 steps are timed)."""
RATES = ["none", "1gbit", "100mbit"]


@dataclass
class Row:
    model: str
    rate: str
    world: int
    method: str
    numel: int
    ms_per_step: float
    bytes_per_step: float
    density: float | None
    steps: int
    """Timed steps."""
    speedup_vs_dense: float | None = None
    """Dense ms/step over this method's."""
    exchange_ms: float | None = None
    """ms/step minus compute's: what the exchange adds to a step."""
    exchange_share: float | None = None
    """exchange_ms / ms_per_step."""
    sync_ms: float | None = None
    """Local methods: ms per step the training loop spent in LocalSteps' syncs and merges
    (``sync_seconds``), whatever the compute-only step did meanwhile."""
    wait_ms: float | None = None
    """Of those, ms per step waiting for an exchange in flight (``wait_seconds``)."""
    compute_ms: float | None = None
    """The compute-only ms/step this method is compared with (``--paired``: the mean of the
    runs just before and after it; else the faster of the first and the last)."""


def square(numel: int) -> nn.Module:
    dim = int(math.sqrt(numel / LAYERS))
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(dim, dim) for _ in range(LAYERS)])


def workload(name: str, numel: int, rank: int) -> tuple[nn.Module, Callable[[int], torch.Tensor]]:
    """The model and ``loss(step)`` of one rank (its own inputs, changing every step)."""
    g = torch.Generator().manual_seed(rank)
    if name == "gpt":
        ids = text()
        net = gpt("gpt-25m", vocab_size(ids))
        batches = [text_batch(ids, 2, 64, g) for _ in range(4)]
        return net, lambda i, m=None: lm_loss((m or net)(batches[i % 4][0]), batches[i % 4][1])
    net = square(numel)
    xs = [torch.randn(8, net[0].in_features, generator=g) for _ in range(4)]
    return net, lambda i, m=None: (m or net)(xs[i % 4]).square().mean()


def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)


def _method(method: str, rank: int, world: int, model: str, numel: int, steps: int) -> dict:
    import gradshare

    net, loss_of = workload(model, numel, rank)
    params = list(net.parameters())
    run: nn.Module = net
    state = None
    if method in ("dense", "fp16", "hook", "hook-1%"):
        run = DDP(net)
    elif method.startswith("powersgd"):
        run = DDP(net, bucket_cap_mb=4096)
    opt = adamw(params)
    if method == "fp16":
        run.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif method.startswith("powersgd"):
        ps = powerSGD_hook.PowerSGDState(
            None, matrix_approximation_rank=int(method.split("-")[1]), start_powerSGD_iter=2
        )
        run.register_comm_hook(ps, powerSGD_hook.powerSGD_hook)
    elif method == "hook":
        state = gradshare.register_threshold_hook(run)  # type: ignore[arg-type]
    elif method == "hook-1%":
        threshold = gradshare.QuantileThreshold(0.01)
        state = gradshare.register_threshold_hook(run, threshold=threshold)  # type: ignore[arg-type]
    elif method == "shared":
        opt = gradshare.SharedOptimizer(opt)
    local = None
    every = 0  # sync_every of a local method
    if method.startswith("local"):
        m = LOCAL_METHOD.match(method)
        assert m is not None, method
        every = int(m["h"] or LOCAL_H)
        overlap = (int(m["tau"]) if m["tau"] else True) if "-overlap" in method else False
        extra = {"density": float(m["pct"]) / 100} if m["pct"] else {}
        local = gradshare.LocalSteps(
            net,
            opt,
            sync_every=every,
            overlap=overlap,
            fragments=int(m["frags"] or 1),
            compact=bool(m["compact"]),
            **extra,
        )
    sent0 = [0]
    spent0 = [0.0, 0.0]  # LocalSteps' sync and wait seconds before the timed steps

    def step(i: int) -> None:
        opt.zero_grad()
        loss_of(i, run).backward()
        opt.step()

    def at_warmup() -> None:
        counter = next(c for c in (state, local, opt) if c is not None)
        sent0[0] = getattr(counter, "bytes_sent", 0)
        if local is not None:
            spent0[:] = [local.sync_seconds, local.wait_seconds]

    if local is None:
        times = timed_steps(
            step, steps=steps, warmup=WARMUP[method], budget_s=BUDGET_S, at_warmup=at_warmup
        )
    else:  # whole rounds, each ending with its sync, after a first round (and sync) untimed
        rounds = max(2, -(-steps // every))
        times = timed_steps(
            step, steps=rounds * every, warmup=every, budget_s=float("inf"), at_warmup=at_warmup
        )
        spent = [
            1e3 * (local.sync_seconds - spent0[0]) / len(times),
            1e3 * (local.wait_seconds - spent0[1]) / len(times),
        ]
        local.close()  # the last round in flight is merged (not timed)
    n = sum(p.numel() for p in params)
    density = None
    if method == "compute":
        sent = 0.0
    elif method == "dense":
        sent = 4.0 * n
    elif method == "fp16":
        sent = 2.0 * n
    elif method.startswith("powersgd"):
        sent = float(powersgd_bytes(net, int(method.split("-")[1])))
    elif local is not None:  # bytes of the rounds whose exchange completed while timed
        sent = (local.bytes_sent - sent0[0]) / len(times)
        if not local.compact:  # DL4J's: 4 bytes per entry
            density = max(sent * every / 4 - 4 * len(params), 0) / n
    else:
        total = state.bytes_sent if state is not None else opt.bytes_sent  # type: ignore[attr-defined]
        sent = (total - sent0[0]) / len(times)
        messages = len(state.encoders) if state is not None else 1
        density = max(sent / 4 - 4 * messages, 0) / n  # sparse: entries plus a header each
    # the local methods' steps differ by design (a sync every H-th): their mean over
    # whole rounds; every other method's steps are alike: their median
    ms = (statistics.mean(times) if local is not None else statistics.median(times)) * 1e3
    row = {
        "method": method,
        "numel": n,
        "ms": ms,
        "bytes": sent,
        "density": density,
        "steps": len(times),
    }
    if local is not None:
        row["sync_ms"], row["wait_ms"] = spent
    return row


def _order(methods: list[str], paired: bool) -> list[str]:
    """compute first and last, and with ``paired`` between every two methods too."""
    if not paired:
        return ["compute", *methods, "compute"]
    return ["compute", *itertools.chain.from_iterable((m, "compute") for m in methods)]


def _rank(
    rank: int,
    world: int,
    port: int,
    model: str,
    numel: int,
    steps: int,
    methods: list[str],
    out: str,
    paired: bool,
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = [_method(m, rank, world, model, numel, steps) for m in _order(methods, paired)]
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def inner(
    model: str, world: int, numel: int, steps: int, methods: list[str], paired: bool = False
) -> list[dict]:
    """Run ``methods`` on a world of ``world`` processes here (in whatever namespace)."""
    os.environ["OMP_NUM_THREADS"] = "1"  # as torchrun sets it for several ranks per host
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.json")
        mp.spawn(
            _rank,
            args=(world, free_port(), model, numel, steps, methods, out, paired),
            nprocs=world,
            join=True,
        )
        rows = json.loads(Path(out).read_text())
    compute = [r for r in rows if r["method"] == "compute"]
    floor = min(compute, key=lambda r: r["ms"])  # the faster: a slow moment cannot shrink it
    for i, r in enumerate(rows):
        if r["method"] != "compute":
            r["compute_ms"] = (rows[i - 1]["ms"] + rows[i + 1]["ms"]) / 2 if paired else floor["ms"]
    print("compute, in order: " + ", ".join(f"{r['ms']:.1f}" for r in compute) + " ms/step")
    return [floor, *(r for r in rows if r["method"] != "compute")]


@contextlib.contextmanager
def shaped_namespace(rate: str) -> Iterator[str]:
    """A fresh network namespace whose loopback is limited to ``rate``; removed on exit."""
    name = f"gradshare-bench-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    try:
        ns = ["ip", "netns", "exec", name]
        subprocess.run([*ns, "ip", "link", "set", "lo", "up"], check=True, capture_output=True)
        tbf = f"tc qdisc add dev lo root tbf rate {rate} burst 1mb latency 100ms".split()
        subprocess.run([*ns, *tbf], check=True, capture_output=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def measure(
    model: str,
    rate: str,
    world: int,
    numel: int,
    steps: int,
    methods: list[str],
    paired: bool = False,
) -> list[Row]:
    if rate == "none":
        raw = inner(model, world, numel, steps, methods, paired)
    else:
        with shaped_namespace(rate) as ns, tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "rows.json"
            flags = ["--inner", str(world), "--models", model, "--numel", str(numel)]
            flags += ["--steps", str(steps), "--methods", *methods, "--out", str(out)]
            flags += ["--paired"] if paired else []
            cmd = ["ip", "netns", "exec", ns, sys.executable, __file__, *flags]
            subprocess.run(cmd, check=True, timeout=3600)
            raw = json.loads(out.read_text())
    dense_ms = next((r["ms"] for r in raw if r["method"] == "dense"), None)  # when measured
    rows = []
    for r in raw:
        measured = (r["method"], r["numel"], r["ms"], r["bytes"], r["density"], r["steps"])
        row = Row(model, rate, world, *measured, sync_ms=r.get("sync_ms"), wait_ms=r.get("wait_ms"))
        if r["method"] != "compute":
            row.speedup_vs_dense = None if dense_ms is None else dense_ms / r["ms"]
            row.compute_ms = r["compute_ms"]
            row.exchange_ms = max(r["ms"] - row.compute_ms, 0.0)
            row.exchange_share = row.exchange_ms / r["ms"]
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
        f"{'model':<7} {'rate':<8} {'world':>5} {'method':<11} {'ms/step':>9} {'vs dense':>9} "
        f"{'exchange':>9} {'share':>6} {'vs comp.':>8} {'in sync':>7} {'waits':>6} "
        f"{'bytes/step':>13} {'density':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        density = f"{r.density:.1e}" if r.density is not None else "-"
        speed = f"{r.speedup_vs_dense:.2f}x" if r.speedup_vs_dense is not None else "-"
        exchange = f"{r.exchange_ms:.0f}" if r.exchange_ms is not None else "-"
        share = f"{r.exchange_share:.0%}" if r.exchange_share is not None else "-"
        ratio = f"{r.ms_per_step / r.compute_ms:.3f}x" if r.compute_ms else "-"
        in_sync = f"{r.sync_ms:.1f}" if r.sync_ms is not None else "-"
        waits = f"{r.wait_ms:.1f}" if r.wait_ms is not None else "-"
        lines.append(
            f"{r.model:<7} {r.rate:<8} {r.world:>5} {r.method:<11} {r.ms_per_step:>9.1f} "
            f"{speed:>9} {exchange:>9} {share:>6} {ratio:>8} {in_sync:>7} {waits:>6} "
            f"{r.bytes_per_step:>13,.0f} {density:>8}"
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
    """ms per step of every method, one group per (rate, world), log scale; a panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in MODELS if any(r.model == m for r in rows)]
    fig, axes = plt.subplots(len(models), 1, figsize=(11, 4.2 * len(models)), squeeze=False)
    for ax, model in zip(axes[:, 0], models, strict=True):
        mine = [r for r in rows if r.model == model]
        groups = sorted({(r.rate, r.world) for r in mine}, key=lambda g: (RATES.index(g[0]), g[1]))
        methods = [m for m in METHODS if any(r.method == m for r in mine)]
        width = 0.8 / max(len(methods), 1)
        for k, m in enumerate(methods):
            xs, ys = [], []
            for g, (rate, world) in enumerate(groups):
                hit = [r for r in mine if (r.rate, r.world, r.method) == (rate, world, m)]
                if hit:
                    xs.append(g + k * width)
                    ys.append(hit[0].ms_per_step)
            ax.bar(xs, ys, width, label=m)
        ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
        ax.set_xticklabels(
            [f"{'loopback' if rate == 'none' else rate}, {world} ranks" for rate, world in groups]
        )
        ax.set_yscale("log")
        numel = mine[0].numel / 1e6
        ax.set(ylabel="ms per step (log)", title=f"{model}: {numel:.1f}M parameters, AdamW")
        ax.legend(fontsize=8, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rates", nargs="+", default=RATES, choices=RATES)
    parser.add_argument("--numel", type=int, default=25_000_000, help="of the square model")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--methods",
        nargs="+",
        default=METHODS[1:],
        choices=METHODS[1:],
        help="besides compute, which is always measured",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "exchange.json")
    parser.add_argument(
        "--paired",
        action="store_true",
        help="measure compute between every two methods too, and compare each "
        "method with the compute runs just before and after it",
    )
    parser.add_argument("--inner", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inner is not None:  # inside a shaped namespace
        raw = inner(args.models[0], args.inner, args.numel, args.steps, args.methods, args.paired)
        args.out.write_text(json.dumps(raw))
        return
    rows: list[Row] = []
    skipped = []
    for model in args.models:
        for rate in args.rates:
            why = None if rate == "none" else can_shape()
            if why:
                skipped.append(f"{rate}: skipped ({why})")
                print(f"rate {rate}: skipped, {why}")
                continue
            worlds = args.worlds[:1] if rate == "100mbit" else args.worlds
            for world in worlds:
                print(f"{model}, rate {rate}, world {world} ...", flush=True)
                rows += measure(
                    model, rate, world, args.numel, args.steps, args.methods, args.paired
                )
                mine = [r for r in rows if (r.model, r.rate, r.world) == (model, rate, world)]
                print(table(mine), flush=True)
    print(table(rows))
    densities = [r.density for r in rows if r.density and r.model == rows[0].model]
    density = statistics.median(densities) if densities else 1e-3
    model_rows = cost_model(rows[0].numel, density)
    print(
        f"\ncost model, N = {rows[0].numel:,}, sparse density {density:.1e} (bytes per rank per "
        "step)"
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
    print(
        f"sparse all-gather beats dense all-reduce while world < 2/density = {crossover:,.0f}; "
        "bitmaps (2 bits/element) only while world < 8"
    )
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
