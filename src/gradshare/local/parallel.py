"""The local multi-worker trainer: DL4J's ParallelWrapper in shared-update mode (docs/design.md §6).

``N`` replicas of one model, one worker thread each (one device each when several GPUs are
given), train on their own minibatches; each worker's own optimizer turns its gradient into an
update, the update goes through the :class:`~gradshare.EncodedGradientsAccumulator`, and every
replica applies the same decoded sum, so the replicas stay bit-identical.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradshare import codec
from gradshare._checks import check_int
from gradshare.codec import threads
from gradshare.codec.flat import views
from gradshare.encoding.options import EncodingOptions, encoding_options
from gradshare.local.accumulator import AccumulatorError, EncodedGradientsAccumulator

__all__ = ["ParallelWrapper", "StepStats"]

logger = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True, slots=True)
class StepStats:
    """One worker's share of one round."""

    epoch: int
    iteration: int
    """The round's number, counted over every ``fit`` of this wrapper."""
    worker: int
    loss: float
    threshold: float | None
    """The threshold of this worker's message (None in dense mode)."""
    format: str | None
    """``"sparse"``, ``"bitmap"``, ``"dense"`` or None (nothing sent)."""
    density: float
    """Kept fraction of the update's elements."""
    message_bytes: int
    dense_bytes: int
    residual_norm: float
    clipped: float
    compute_s: float
    """Seconds of forward, backward and the local optimizer step."""
    share_s: float
    """Seconds of encode, waiting for the round, decode and apply."""


class ParallelWrapper:
    """Train one model with ``num_workers`` local replicas sharing threshold-encoded updates.

    Each round deals one minibatch to each worker; each worker:

    1. runs forward and backward on its replica, and its own optimizer's ``step()``;
    2. takes the update that step made (parameters before minus after) and restores the
       parameters, then hands the update to the accumulator, which encodes it (residual kept);
    3. after every active worker stored, applies ``params -= Σ decoded messages``.

    The last round of an epoch may have fewer workers; the idle replicas apply that round's
    messages too, so every replica is the same after every round. After :meth:`fit` the user's
    ``model`` holds the trained parameters (and worker 0's buffers).

    Args:
        model: the model to train (not modified until :meth:`fit` ends).
        optimizer_factory: ``params -> torch.optim.Optimizer``, called once per replica.
        loss_fn: ``(output, target) -> scalar loss``.
        num_workers: replicas and threads.
        devices: one device per worker; default one per GPU when several are present, else
            the model's device for all.
        options: the encoding settings (:class:`~gradshare.EncodingOptions`), or give its
            fields as keywords: ``threshold`` (cloned per worker), ``post_processor``,
            ``boundary``, ``magnitude``, ``dense`` (share exact dense updates: the oracle),
            ``reduction`` (``"sum"`` by default, DL4J: each worker's update applies in full;
            or ``"mean"``), ``timeout`` (how long a worker waits for the others).

    Example::

        >>> wrapper = ParallelWrapper(model, lambda p: torch.optim.SGD(p, lr=0.1),
        ...                           torch.nn.functional.cross_entropy, num_workers=4)
        >>> wrapper.fit(train_loader, epochs=3)  # doctest: +SKIP
        >>> wrapper.evaluate(test_loader)  # doctest: +SKIP
        {'loss': 0.21, 'accuracy': 0.95}
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer_factory: Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        num_workers: int = 2,
        devices: Sequence[torch.device | str] | None = None,
        options: EncodingOptions | None = None,
        **encoding: Any,
    ) -> None:
        options = encoding_options(options, encoding, "ParallelWrapper")
        if not isinstance(model, nn.Module):
            raise TypeError(f"Expect `model` to be a torch.nn.Module, got {type(model).__name__}.")
        check_int(num_workers, "num_workers")
        params = list(model.parameters())
        if not params:
            raise ValueError("Expect a model with parameters: there is nothing to train.")
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise ValueError(
                f"Expect every parameter of one floating dtype, got {sorted(map(str, dtypes))}:"
                " cast the model with `.to(dtype)` first."
            )
        self.model = model
        self.loss_fn = loss_fn
        self.num_workers = num_workers
        self.devices = _devices(devices, num_workers, params[0].device)
        self.replicas: list[nn.Module] = []
        self._flat: list[torch.Tensor] = []
        self._before: list[torch.Tensor] = []
        self._update: list[torch.Tensor] = []
        for device in self.devices:
            replica = copy.deepcopy(model).to(device)
            self._flat.append(_flatten_params(replica))
            self._before.append(torch.empty_like(self._flat[-1]))
            self._update.append(torch.empty_like(self._flat[-1]))
            self.replicas.append(replica)
        self.optimizers = [optimizer_factory(r.parameters()) for r in self.replicas]
        self.accumulator = EncodedGradientsAccumulator(num_workers, options=options)
        self.iteration = 0
        self.epoch = 0
        self.history: list[StepStats] = []
        """Per-round, per-worker stats of every :meth:`fit`."""
        mode = "dense" if options.dense else options.algorithm()
        logger.info(
            "ParallelWrapper: %d workers on %s, %d elements per replica, %s, reduction %s",
            num_workers,
            sorted({str(d) for d in self.devices}),
            self.numel,
            mode,
            self.accumulator.reduction,
        )

    @property
    def numel(self) -> int:
        """Parameters per replica."""
        return self._flat[0].numel()

    # ------------------------------------------------------------------ training

    def fit(
        self,
        data: Iterable[Batch],
        epochs: int = 1,
        callback: Callable[[list[StepStats]], None] | None = None,
    ) -> list[StepStats]:
        """Train on ``data`` (minibatches ``(inputs, targets)``) for ``epochs`` passes.

        Minibatches are dealt to the workers in turn, one round = one per active worker.
        ``callback`` gets each round's stats (a progress bar, a logger: the library draws
        none itself). Returns the stats of this call's rounds.
        If a worker raises, every worker stops and ``fit`` re-raises that error.
        """
        check_int(epochs, "epochs")
        self._load_model_into_replicas()
        start = len(self.history)
        try:
            with ThreadPoolExecutor(self.num_workers, thread_name_prefix="gradshare") as pool:
                for _ in range(epochs):
                    for batches in _rounds(data, self.num_workers):
                        stats = self._round(pool, batches)
                        self.history += stats
                        if callback is not None:
                            callback(stats)
                    self.epoch += 1
        finally:
            self.accumulator.reset()
        self._store_replica_into_model()
        return self.history[start:]

    def _round(self, pool: ThreadPoolExecutor, batches: list[Batch]) -> list[StepStats]:
        active = len(batches)
        self.accumulator.register_consumers(active)
        iteration = self.iteration
        futures: list[Future[StepStats]] = [
            pool.submit(self._work, w, batches[w], iteration) for w in range(active)
        ]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        if any(f.exception() is not None for f in done):
            wait(futures)  # the accumulator wakes and fails the rest promptly
            raise _first_error(futures)
        for w in range(active, self.num_workers):  # idle replicas apply this round too
            self.accumulator.apply_update(w, self._flat[w])
        self.iteration += 1
        stats = [f.result() for f in futures]
        if logger.isEnabledFor(logging.DEBUG):
            sent = sum(s.message_bytes for s in stats)
            logger.debug(
                "ParallelWrapper round %d: %d workers sent %d bytes", iteration, active, sent
            )
        return stats

    def _work(self, w: int, batch: Batch, iteration: int) -> StepStats:
        try:
            # workers that fill this process's share of the cores run the kernels serially
            serial = self.num_workers >= threads.kernel_threads()
            with codec.serial_kernels() if serial else contextlib.nullcontext():
                return self._step(w, batch, iteration)
        except BaseException as e:
            self.accumulator.fail(w, e)
            raise

    def _step(self, w: int, batch: Batch, iteration: int) -> StepStats:
        replica, opt, flat, before = (
            self.replicas[w],
            self.optimizers[w],
            self._flat[w],
            self._before[w],
        )
        device = self.devices[w]
        start = time.perf_counter()
        inputs, targets = batch
        before.copy_(flat)
        opt.zero_grad(set_to_none=True)
        loss = self.loss_fn(replica(inputs.to(device)), targets.to(device))
        loss.backward()
        opt.step()
        with torch.no_grad():  # what the step did, checked; the parameters put back exactly
            update = codec.take_update_(before, flat, self._update[w], restore=True)
        compute = time.perf_counter() - start
        acc = self.accumulator
        acc.store_update(w, update, iteration, self.epoch, finite=True)
        acc.apply_update(w, flat)
        share = time.perf_counter() - start - compute
        return _stats(
            acc, w, self.epoch, iteration, float(loss.detach()), compute, share, flat.numel()
        )

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self, data: Iterable[Batch]) -> dict[str, float]:
        """Mean loss (and accuracy, for class-index targets) of the trained model on ``data``."""
        replica, device = self.replicas[0], self.devices[0]
        was_training = replica.training
        replica.eval()
        total_loss, correct, count, classified = 0.0, 0, 0, True
        try:
            for inputs, targets in data:
                out = replica(inputs.to(device))
                targets = targets.to(device)
                n = targets.shape[0]
                total_loss += float(self.loss_fn(out, targets)) * n
                count += n
                if out.dim() == 2 and targets.dim() == 1 and not targets.is_floating_point():
                    correct += int((out.argmax(1) == targets).sum())
                else:
                    classified = False
        finally:
            replica.train(was_training)
        if count == 0:
            raise ValueError("Expect `data` with at least one minibatch, got none.")
        result = {"loss": total_loss / count}
        if classified:
            result["accuracy"] = correct / count
        return result

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        """Replicas' modules, each worker's optimizer, the accumulator (residuals) and counters."""
        return {
            "num_workers": self.num_workers,
            "replicas": [copy.deepcopy(r.state_dict()) for r in self.replicas],
            "optimizers": [copy.deepcopy(o.state_dict()) for o in self.optimizers],
            "accumulator": self.accumulator.state_dict(),
            "iteration": self.iteration,
            "epoch": self.epoch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` into this wrapper and its ``model``."""
        if state.get("num_workers") != self.num_workers:
            raise ValueError(
                f"Checkpoint is of {state.get('num_workers')} workers, this wrapper has "
                f"{self.num_workers}: build it with the same `num_workers`."
            )
        self.accumulator.load_state_dict(state["accumulator"])
        for replica, saved in zip(self.replicas, state["replicas"], strict=True):
            replica.load_state_dict(saved)
        for opt, saved in zip(self.optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(saved)
        self.iteration = int(state["iteration"])
        self.epoch = int(state["epoch"])
        self._store_replica_into_model()

    # ------------------------------------------------------------------ model <-> replicas

    @torch.no_grad()
    def _load_model_into_replicas(self) -> None:
        source = dict(self.model.named_parameters())
        for replica in self.replicas:
            for name, p in replica.named_parameters():
                p.copy_(source[name])

    @torch.no_grad()
    def _store_replica_into_model(self) -> None:
        self.model.load_state_dict(self.replicas[0].state_dict())


def _devices(
    devices: Sequence[torch.device | str] | None, num_workers: int, default: torch.device
) -> list[torch.device]:
    if devices is None:
        count = torch.cuda.device_count() if default.type == "cuda" else 0
        if count > 1:
            return [torch.device("cuda", w % count) for w in range(num_workers)]
        return [default] * num_workers
    if len(devices) != num_workers:
        raise ValueError(
            f"Expect one device per worker ({num_workers}), got {len(devices)}: {list(devices)}."
        )
    return [torch.device(d) for d in devices]


def _flatten_params(module: nn.Module) -> torch.Tensor:
    """Make ``module``'s parameters views of one flat tensor, which is returned."""
    params = list(module.parameters())
    flat = torch.empty(
        sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device
    )
    with torch.no_grad():
        for p, piece in views(flat, params):
            piece.copy_(p)
            p.data = piece
    return flat


def _rounds(data: Iterable[Batch], num_workers: int) -> Iterator[list[Batch]]:
    batches: list[Batch] = []
    for batch in data:
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise TypeError(
                "Expect each minibatch as (inputs, targets), got "
                f"{type(batch).__name__}: wrap a dataset in a DataLoader of pairs."
            )
        batches.append((batch[0], batch[1]))
        if len(batches) == num_workers:
            yield batches
            batches = []
    if batches:
        yield batches


def _stats(
    acc: EncodedGradientsAccumulator,
    w: int,
    epoch: int,
    iteration: int,
    loss: float,
    compute: float,
    share: float,
    numel: int,
) -> StepStats:
    s = acc.last_stats[w]
    if acc.dense or s is None:
        return StepStats(
            epoch=epoch,
            iteration=iteration,
            worker=w,
            loss=loss,
            threshold=None,
            format="dense",
            density=1.0,
            message_bytes=4 * numel,
            dense_bytes=4 * numel,
            residual_norm=0.0,
            clipped=0.0,
            compute_s=compute,
            share_s=share,
        )
    return StepStats(
        epoch=epoch,
        iteration=iteration,
        worker=w,
        loss=loss,
        threshold=s.threshold,
        format=s.format,
        density=s.density,
        message_bytes=s.message_bytes,
        dense_bytes=s.dense_bytes,
        residual_norm=s.residual_norm,
        clipped=s.clipped,
        compute_s=compute,
        share_s=share,
    )


def _first_error(futures: list[Future[StepStats]]) -> BaseException:
    """The original failure: a worker's own error rather than the others' AccumulatorError."""
    errors = [e for f in futures if (e := f.exception()) is not None]
    for e in errors:
        if not isinstance(e, AccumulatorError):
            return e
    return errors[0]
