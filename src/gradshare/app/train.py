"""The main job: one model trained with dense updates, with gradshare, and with local steps.

``gradshare train`` runs :func:`run`: scikit-learn's digits, an MLP, ``workers`` replicas
(threads through :class:`~gradshare.ParallelWrapper`, or processes through
:class:`~gradshare.SharedOptimizer` over gloo), first sharing exact dense updates, then
threshold-encoded ones every step, then (processes, :class:`~gradshare.LocalSteps`) syncing
encoded pseudo-gradients every ``local_steps`` steps, with the same seed, data order and
optimizer. Every step of every worker is recorded; :mod:`gradshare.app.report` writes the files
and the plot.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from gradshare.app.datasets import (
    Split,
    digits,
    digits_train_size,
    minibatches,
    mlp,
)
from gradshare.codec import NonFiniteUpdate, float32_threshold
from gradshare.distributed.hosts import rendezvous_port
from gradshare.distributed.local_steps.options import (
    DEFAULT_DECAY,
    DEFAULT_DENSITY,
    LocalStepsOptions,
)
from gradshare.encoding.residual import ResidualClipping, ResidualPostProcessor
from gradshare.encoding.threshold import (
    AdaptiveThreshold,
    FixedThreshold,
    TargetDensityThreshold,
    ThresholdAlgorithm,
)

__all__ = [
    "Diverged",
    "RunResult",
    "TrainConfig",
    "parse_clip",
    "parse_threshold",
    "run",
    "run_one",
]

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr),
    "momentum": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
    "adam": lambda params, lr: torch.optim.Adam(params, lr=lr),
}
THRESHOLD_KINDS = ("adaptive", "fixed", "target")
LOCAL = "local-steps"
"""The run that syncs every ``local_steps`` steps (processes, LocalSteps)."""
OUTER_LR = 1.4
"""The local-steps run's outer SGD learning rate: plain SGD on an MLP with its workers'
pseudo-gradients summed (gradshare's DEFAULT_OUTER_LR suits averaged ones under AdamW)."""


def parse_threshold(spec: str) -> ThresholdAlgorithm:
    """``adaptive:1e-3`` -> AdaptiveThreshold(1e-3); also ``fixed:T`` and ``target:DENSITY``."""
    kind, _, value = spec.partition(":")
    if kind not in THRESHOLD_KINDS:
        raise ValueError(
            f"unknown threshold kind {kind!r} in {spec!r}; use "
            + ", ".join(f"{k}:VALUE" for k in THRESHOLD_KINDS)
        )
    try:
        t = float(value) if value else 1e-3
    except ValueError:
        raise ValueError(f"threshold value {value!r} in {spec!r} is not a number") from None
    if kind == "target":
        return TargetDensityThreshold(initial=1e-3, target=t)
    try:
        float32_threshold(t)  # the wire stores it as float32: 1e-46 or 1e39 would not survive
    except ValueError:
        raise ValueError(
            f"threshold {value} in {spec!r} is not a finite float32 > 0 (about 1.2e-38 to "
            "3.4e38): every message stores it as float32"
        ) from None
    return AdaptiveThreshold(t) if kind == "adaptive" else FixedThreshold(t)


def parse_clip(spec: str | None) -> ResidualPostProcessor | None:
    """``5:5`` -> ResidualClipping(5, 5); None -> no post-processing."""
    if spec is None:
        return None
    multiple, _, frequency = spec.partition(":")
    try:
        return ResidualClipping(float(multiple), int(frequency or 5))
    except ValueError as e:
        raise ValueError(f"{spec!r} is not MULTIPLE:FREQUENCY (e.g. 5:5): {e}") from None


class Diverged(ValueError):
    """A run's updates became inf or NaN (the learning rate is too large, say): reported by
    the CLI in one line."""


MAX_SEED = 2**63 - 1
"""The largest ``--seed``: torch's generators take 64-bit seeds, and epoch e shuffles with
seed + e."""

Mode = Literal["parallel", "distributed"]
OptimizerName = Literal["sgd", "momentum", "adam"]


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """What ``gradshare train`` runs. The command line is built from these fields (each
    field is the option ``--name``, its default and the first line of its docstring the
    option's default and help), so the two never disagree."""

    workers: int = 4
    """Replicas: threads or processes."""
    mode: Mode = "parallel"
    """parallel (threads, ParallelWrapper) or distributed (processes, gloo)."""
    threshold: str = "adaptive:1e-3"
    """The threshold algorithm: adaptive:T, fixed:T or target:DENSITY."""
    clip: str | None = None
    """Residual clipping MULTIPLE:FREQUENCY, e.g. 5:5 (default: none)."""
    optimizer: OptimizerName = "sgd"
    """sgd, momentum (SGD 0.9) or adam; each worker has its own."""
    lr: float = 0.1
    """Learning rate of each worker."""
    epochs: int = 8
    """Passes over the training set."""
    batch_size: int = 32
    """Minibatch of one worker."""
    hidden: int = 256
    """Hidden units of the MLP."""
    seed: int = 0
    """Seed: the same seed, the same numbers."""
    device: str = "cpu"
    """cpu or cuda[:N]."""
    local_steps: int = 5
    """Inner steps between the syncs of the local-steps run (0: no such run).

    LocalSteps' ``sync_every``; at most the run's steps: a run that never syncs sends
    nothing."""
    density: float = DEFAULT_DENSITY
    """Fraction of each parameter a local-steps sync sends, in (0, 1/16), or 1.0 (dense)."""
    decay: float = DEFAULT_DECAY
    """β of the local-steps run's residuals, in [0, 1]."""
    overlap: int = 0
    """Steps each local-steps exchange runs behind, up to --local-steps (0: none)."""
    fragments: int = 1
    """Parts of the model the local-steps run syncs in turn."""
    compact: bool = True
    """Send the local-steps syncs' sparse pieces in their compact form (about 7 bits per entry)."""
    runs: tuple[str, ...] = ("dense", "gradshare", "local-steps")
    """Which runs, in order (not an option: the command runs all three)."""

    def __post_init__(self) -> None:
        local = self.local_steps
        if isinstance(local, bool) or not isinstance(local, int) or local < 0:
            raise ValueError(f"--local-steps must be an integer >= 0, got {local!r}")
        self.local_options()
        for name in ("workers", "epochs", "batch_size", "hidden"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}"
                )
        self._check_something_is_sent()
        seed = self.seed
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
            raise ValueError(f"--seed must be an integer from 0 to 2**63 - 1, got {seed!r}")
        if self.mode not in get_args(Mode):
            raise ValueError(f"--mode must be parallel or distributed, got {self.mode!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}"
            )
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(
                f"--lr must be finite and > 0, got {self.lr!r}: it scales every step, and an "
                "infinite one makes the first update non-finite"
            )
        for option, parse, value in (
            ("--threshold", parse_threshold, self.threshold),
            ("--clip", parse_clip, self.clip),
        ):
            try:
                parse(value)  # type: ignore[arg-type]
            except ValueError as e:
                raise ValueError(f"{option}: {e}") from None
        try:
            device = torch.device(self.device)
        except RuntimeError:
            raise ValueError(
                f"--device {self.device!r} is not a device (cpu, cuda, cuda:1)"
            ) from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {self.device}: CUDA is not available here; use cpu")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")

    def local_options(self) -> LocalStepsOptions:
        """The local-steps run's :class:`~gradshare.LocalStepsOptions`, validated there (a
        ValueError names the option)."""
        fields = ("density", "decay", "overlap", "fragments", "compact")
        try:
            local = LocalStepsOptions(
                sync_every=max(self.local_steps, 1), **{k: getattr(self, k) for k in fields}
            )
            local.check(None, self.density == 1.0, 4)  # the MLP's 4 tensors
        except (TypeError, ValueError) as e:
            named = next((k for k in ("sync_every", *fields) if f"`{k}`" in str(e)), "")
            flag = "--local-steps" if named == "sync_every" else f"--{named}"
            raise ValueError(f"{flag}: {e}") from None
        return local

    def _check_something_is_sent(self) -> None:
        """Refuse settings under which a run of processes takes no step, or the local-steps
        run never syncs or sends no entry: it would train alone and report 0 bytes sent."""
        images = digits_train_size()
        batches = -(-images // self.batch_size)
        rounds = batches // self.workers  # processes take whole rounds, one batch per worker
        processes = self.mode == "distributed" or self.local_steps
        if processes and rounds == 0:  # so 2 workers or more
            most = -(-images // (self.workers - 1)) - 1  # the largest that cuts >= workers
            raise ValueError(
                f"--batch-size {self.batch_size} cuts the {images} training images into "
                f"{batches} minibatches, fewer than the {self.workers} workers: processes take "
                "whole rounds of one minibatch per worker, so no step would be taken; expect "
                f"--batch-size {most} or less, or fewer --workers"
            )
        steps = self.epochs * rounds
        if self.local_steps > steps:
            raise ValueError(
                f"--local-steps {self.local_steps} is more than the {steps} steps of the "
                f"local-steps run ({self.epochs} epochs of {rounds} rounds): it would never "
                f"sync, and send nothing; expect --local-steps from 1 to {steps} (0: no such run)"
            )


@dataclass
class RunResult:
    """One run (dense or gradshare): per-step rows, per-epoch accuracy, totals."""

    name: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    """One per step and worker: epoch, step, worker, loss, threshold, density, ..."""
    epochs: list[dict[str, float]] = field(default_factory=list)
    """One per epoch: epoch, test loss, test accuracy."""
    seconds: float = 0.0

    @property
    def accuracy(self) -> float:
        return self.epochs[-1]["accuracy"]

    @property
    def bytes_sent(self) -> int:
        return sum(r["message_bytes"] for r in self.rows)

    @property
    def dense_bytes(self) -> int:
        return sum(r["dense_bytes"] for r in self.rows)

    @property
    def compression_ratio(self) -> float | None:
        """Dense bytes / sent bytes; None when nothing was sent."""
        return self.dense_bytes / self.bytes_sent if self.bytes_sent else None

    def summary(self) -> dict[str, Any]:
        return {
            "accuracy": self.accuracy,
            "test_loss": self.epochs[-1]["loss"],
            "seconds": self.seconds,
            "bytes_sent": self.bytes_sent,
            "dense_bytes": self.dense_bytes,
            "compression_ratio": self.compression_ratio,
            "steps": len({(r["epoch"], r["step"]) for r in self.rows}),
        }


def _model(config: TrainConfig, split: Split) -> nn.Module:
    return mlp(split.num_features, split.num_classes, hidden=config.hidden, seed=config.seed)


def _epoch_batches(config: TrainConfig, split: Split, epoch: int) -> list:
    return minibatches(split.x_train, split.y_train, config.batch_size, seed=config.seed + epoch)


@torch.no_grad()
def _evaluate(model: nn.Module, split: Split, device: torch.device) -> dict[str, float]:
    was = model.training
    model.eval()
    out = model(split.x_test.to(device))
    y = split.y_test.to(device)
    model.train(was)
    return {
        "loss": float(F.cross_entropy(out, y)),
        "accuracy": float((out.argmax(1) == y).float().mean()),
    }


def _row(
    name: str, epoch: int, step: int, worker: int, loss: float, stats: Any, numel: int
) -> dict:
    """One metrics row; ``stats`` is the step's EncodeStats/StepStats, None for dense."""
    row = {"run": name, "epoch": epoch, "step": step, "worker": worker, "loss": loss}
    if stats is None:
        row.update(
            threshold=None,
            density=1.0,
            message_bytes=4 * numel,
            dense_bytes=4 * numel,
            format="dense",
            residual_norm=0.0,
            clipped=0.0,
        )
        return row
    row.update(
        threshold=stats.threshold,
        density=stats.density,
        message_bytes=stats.message_bytes,
        dense_bytes=stats.dense_bytes,
        format=stats.format or "none",
        residual_norm=stats.residual_norm,
        clipped=stats.clipped,
    )
    return row


# ---------------------------------------------------------------------- threads


def _run_parallel(config: TrainConfig, name: str, split: Split, bar: Any) -> RunResult:
    from gradshare.local.parallel import ParallelWrapper

    device = torch.device(config.device)
    result = RunResult(name)
    wrapper = ParallelWrapper(
        _model(config, split).to(device),
        lambda p: OPTIMIZERS[config.optimizer](p, config.lr),
        F.cross_entropy,
        num_workers=config.workers,
        threshold=None if name == "dense" else parse_threshold(config.threshold),
        dense=name == "dense",
        post_processor=None if name == "dense" else parse_clip(config.clip),
    )
    for epoch in range(config.epochs):

        def record(stats: list, epoch: int = epoch) -> None:
            for s in stats:
                threshold = None if s.format == "dense" else s
                result.rows.append(
                    _row(name, epoch, s.iteration, s.worker, s.loss, threshold, wrapper.numel)
                )
            _tick(bar, result)

        wrapper.fit(_epoch_batches(config, split, epoch), callback=record)
        result.epochs.append({"epoch": epoch, **_evaluate(wrapper.model, split, device)})
        _tick(bar, result, 0)
    return result


# ---------------------------------------------------------------------- processes


def _rank_main(rank: int, config: TrainConfig, name: str, port: int, tmp: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    world = config.workers
    cuda = torch.device(config.device).type == "cuda"
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    split = digits(seed=config.seed)
    model = _model(config, split).to(device)
    if name == LOCAL:
        result = _train_local(config, model, split, rank, world, device)
    else:
        result = _train_shared(config, name, model, split, rank, world, device, tmp)
    torch.save(asdict(result), Path(tmp) / f"rank{rank}.pt")
    dist.destroy_process_group()


def _rank_batches(config: TrainConfig, split: Split, epoch: int, rank: int, world: int) -> list:
    batches = _epoch_batches(config, split, epoch)
    return batches[: len(batches) // world * world][rank::world]


def _train_shared(
    config: TrainConfig,
    name: str,
    model: nn.Module,
    split: Split,
    rank: int,
    world: int,
    device: torch.device,
    tmp: str,
) -> RunResult:
    """Every step shared (SharedOptimizer); a diverged update is written to ``tmp`` for the
    parent to report in one line."""
    from gradshare.distributed.shared_optimizer import SharedOptimizer

    opt = SharedOptimizer(
        OPTIMIZERS[config.optimizer](model.parameters(), config.lr),
        threshold=None if name == "dense" else parse_threshold(config.threshold),
        dense=name == "dense",
        post_processor=None if name == "dense" else parse_clip(config.clip),
    )
    result = RunResult(name)
    numel = sum(p.numel() for p in model.parameters())
    step = 0
    for epoch in range(config.epochs):
        for x, y in _rank_batches(config, split, epoch, rank, world):
            opt.zero_grad()
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
            loss.backward()
            try:
                opt.step()
            except NonFiniteUpdate as e:  # the parent reports it; the other ranks stop too
                (Path(tmp) / f"diverged-rank{rank}.txt").write_text(_diverged(name, epoch, e))
                raise
            result.rows.append(_row(name, epoch, step, rank, loss.item(), opt.last_stats, numel))
            step += 1
        result.epochs.append({"epoch": epoch, **_evaluate(model, split, device)})
    return result


def _train_local(
    config: TrainConfig, model: nn.Module, split: Split, rank: int, world: int, device: torch.device
) -> RunResult:
    """Each rank steps alone; every ``local_steps`` steps a LocalSteps sync, whose outer
    gradient is the ranks' pseudo-gradients summed, as the other two runs sum the workers'
    updates (DL4J's rule; averaging them would take a quarter of the step with 4 workers). A
    row's bytes are
    what the sync of that step sent (0 between syncs), its dense bytes what DDP would have
    sent that step (4 per element), so the compression is against every-step dense sharing."""
    from gradshare.distributed.local_steps import LocalSteps

    inner = OPTIMIZERS[config.optimizer](model.parameters(), config.lr)
    result = RunResult(LOCAL)
    numel = sum(p.numel() for p in model.parameters())
    step = 0
    # summed like the other runs' updates (DL4J's sum), not averaged, so OUTER_LR, not the
    # default 2.8 (tuned on averaged AdamW syncs; summed over 4 workers it gave 0.67 accuracy
    # against 0.94 dense)
    local = dataclasses.replace(
        config.local_options(), outer_optimizer=lambda p: torch.optim.SGD(p, lr=OUTER_LR)
    )
    sync = LocalSteps(model, inner, local=local, reduction="sum")
    with sync:
        for epoch in range(config.epochs):
            for x, y in _rank_batches(config, split, epoch, rank, world):
                inner.zero_grad()
                loss = F.cross_entropy(model(x.to(device)), y.to(device))
                loss.backward()
                sent, syncs = sync.bytes_sent, sync.syncs
                inner.step()  # every local_steps-th step ends with the sync
                sent = sync.bytes_sent - sent
                row = _local_row(epoch, step, rank, float(loss.detach()), sync, syncs, sent, numel)
                result.rows.append(row)
                step += 1
            result.epochs.append({"epoch": epoch, **_evaluate(model, split, device)})
    return result


def _local_row(
    epoch: int, step: int, worker: int, loss: float, sync: Any, before: int, sent: int, numel: int
) -> dict[str, Any]:
    row = {"run": LOCAL, "epoch": epoch, "step": step, "worker": worker, "loss": loss}
    row.update(message_bytes=sent, dense_bytes=4 * numel, clipped=0.0)
    if sync.syncs == before:
        return {**row, "threshold": None, "density": 0.0, "format": "local", "residual_norm": 0.0}
    stats = [e.last_stats for e in sync.encoders if e.last_stats is not None]
    entries = sum(s.entries for s in stats)
    return {
        **row,
        "threshold": max((s.threshold for s in stats), default=None),
        "density": entries / numel if stats else 1.0,
        "format": "sync",
        "residual_norm": sum(s.residual_norm**2 for s in stats) ** 0.5,
    }


def _diverged(name: str, epoch: int | None, error: Exception) -> str:
    where = "" if epoch is None else f" in epoch {epoch}"
    return f"the {name} run diverged{where}: {error}"


def _stop(processes: list[Any], grace: float = 5.0) -> None:
    """Terminate the ranks still running, and kill those that do not stop within ``grace``."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def _run_distributed(config: TrainConfig, name: str, split: Split, bar: Any) -> RunResult:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        context = None
        try:
            # daemonic: should anything leave a rank running, the interpreter's exit ends it
            # instead of waiting for it
            context = mp.start_processes(
                _rank_main,
                args=(config, name, rendezvous_port(), tmp),
                nprocs=config.workers,
                join=False,
                daemon=True,
                start_method="spawn",
            )
            while not context.join():
                pass
        except BaseException:  # Ctrl-C (or a failed rank): stop every rank, then raise
            # a Ctrl-C while the ranks start leaves no context: stop those already started
            _stop(context.processes if context is not None else multiprocessing.active_children())
            diverged = sorted(Path(tmp).glob("diverged-rank*.txt"))
            if diverged:
                raise Diverged(diverged[0].read_text()) from None
            raise
        # each rank saved plain dicts, lists, strings and numbers: nothing else may load
        parts = [
            torch.load(Path(tmp) / f"rank{r}.pt", weights_only=True) for r in range(config.workers)
        ]
    result = RunResult(name, epochs=parts[0]["epochs"])
    result.rows = sorted(
        (r for p in parts for r in p["rows"]), key=lambda r: (r["step"], r["worker"])
    )
    _tick(bar, result, len({r["step"] for r in result.rows}))
    return result


# ---------------------------------------------------------------------- both runs


def _tick(bar: Any, result: RunResult, n: int = 1) -> None:
    if bar is None or not result.rows:
        return
    bar.update(n)
    last = result.rows[-1]
    postfix = {"loss": f"{last['loss']:.3f}", "bytes": f"{result.bytes_sent:,}"}
    if result.epochs:
        postfix["acc"] = f"{result.epochs[-1]['accuracy']:.3f}"
    if last["threshold"] is not None:
        postfix["threshold"] = f"{last['threshold']:.2e}"
        postfix["density"] = f"{last['density']:.1e}"
    bar.set_postfix(postfix, refresh=False)


def run_one(config: TrainConfig, name: str, progress: bool = True) -> RunResult:
    """Train once: ``name`` is ``dense`` (exact updates), ``gradshare`` (encoded every step)
    or ``local-steps`` (LocalSteps, always as processes)."""
    split = digits(seed=config.seed)
    batches = -(-len(split.y_train) // config.batch_size)
    processes = config.mode == "distributed" or name == LOCAL
    rounds = batches // config.workers if processes else -(-batches // config.workers)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=config.epochs * rounds, desc=f"{name:>9}", unit="step", leave=True)
    start = time.perf_counter()
    try:
        runner = _run_distributed if processes else _run_parallel
        result = runner(config, name, split, bar)
    except NonFiniteUpdate as e:
        raise Diverged(_diverged(name, None, e)) from None
    finally:
        if bar is not None:
            bar.close()
    result.seconds = time.perf_counter() - start
    return result


def run(config: TrainConfig, progress: bool = True) -> Iterator[RunResult]:
    """Each of ``config.runs`` in turn, with the same seed and data (the local-steps run
    only with ``local_steps >= 1``)."""
    for name in config.runs:
        if name != LOCAL or config.local_steps:
            yield run_one(config, name, progress)
