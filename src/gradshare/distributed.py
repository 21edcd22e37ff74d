"""Update sharing over torch.distributed: the message exchange and SharedOptimizer (SPEC §6).

Where DL4J sends each message over its own UDP transport, gradshare exchanges them with the
collectives PyTorch users already run (gloo on CPU, NCCL on CUDA), launched by ``torchrun``:

1. every rank all-gathers a small header ``[status, words, numel]`` (fixed size);
2. every rank checks that all ranks encode vectors of one size and that none failed locally;
3. every rank all-gathers its int32 message padded to the longest, and trims each back.

Nothing is pickled: only int64 headers and int32 messages travel. Each message is validated
whole before any element is decoded, so a corrupted one raises the same :class:`MessageError`
on every rank instead of a silent divergence.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

# torch.distributed.nn.functional binds `group=group.WORLD` as argument defaults when first
# imported, and torch imports it lazily (torch._dynamo does, e.g. on a first torch.optim
# optimizer). Imported after init_process_group, those defaults hold the default group for
# good: destroy_process_group() cannot free it, its gloo threads outlive the interpreter, and
# one may take the GIL during finalization (to release the last tensors of a collective) and
# abort the process ("terminate called without an active exception"). Imported here, before
# any group exists, those defaults are None.
import torch.distributed.nn.functional

from gradshare import codec
from gradshare.accumulator import to_seconds
from gradshare.encoder import Encoder, EncodeStats
from gradshare.residual import ResidualPostProcessor
from gradshare.threshold import AdaptiveThreshold, ThresholdAlgorithm

__all__ = ["ExchangeError", "SharedOptimizer", "exchange_messages"]

_OK, _FAILED = 0, 1


class ExchangeError(RuntimeError):
    """The exchange of messages failed on this rank because of another rank (or the network)."""


def _wait(work: Any, timeout: timedelta, what: str, rank: int) -> None:
    start = time.monotonic()
    try:
        work.wait(timeout)
    except Exception as e:
        waited = time.monotonic() - start
        raise ExchangeError(
            f"Rank {rank}: the {what} failed after {waited:.1f} s (timeout "
            f"{timeout.total_seconds():g} s): a peer raised, was killed, or the network is down. "
            f"Original error: {type(e).__name__}: {e}"
        ) from e


def exchange_messages(
    message: torch.Tensor | None,
    numel: int,
    *,
    group: Any = None,
    timeout: timedelta = timedelta(seconds=300),
    device: torch.device | None = None,
    failure: BaseException | None = None,
) -> list[torch.Tensor | None]:
    """All-gather every rank's message for a vector of ``numel`` elements, in rank order.

    ``message`` is this rank's int32 message or None (nothing to send). Pass ``failure`` when
    this rank could not encode: the others then raise :class:`ExchangeError` naming it, and
    this rank re-raises ``failure`` — so one rank's bad input stops every rank, promptly.
    Decode them with :func:`gradshare.codec.decode_sum_` or :func:`~gradshare.codec.subtract_sum_`,
    which validate each whole first and name a bad one's rank.

    Raises:
        ExchangeError: another rank failed, the ranks' vector sizes differ, or a collective
            failed or timed out.
    """
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    if device is None:
        device = message.device if message is not None else torch.device("cpu")
    words = 0 if message is None else message.numel()
    status = _OK if failure is None else _FAILED
    header = torch.tensor([status, words, numel], dtype=torch.int64, device=device)
    headers = [torch.empty_like(header) for _ in range(world)]
    _wait(
        dist.all_gather(headers, header, group=group, async_op=True), timeout, "size exchange", rank
    )
    table = torch.stack(headers).cpu().tolist()
    failed = [r for r, h in enumerate(table) if h[0] != _OK]
    if failure is not None:
        raise failure
    if failed:
        raise ExchangeError(
            f"Rank {rank}: rank(s) {failed} failed to encode their update this step (see their "
            "own error); every rank stops here."
        )
    sizes = {r: h[2] for r, h in enumerate(table)}
    if len(set(sizes.values())) != 1:
        raise ExchangeError(
            f"Rank {rank}: the ranks share vectors of different sizes {sizes}: every rank must "
            "hold the same model (same parameters, same order)."
        )
    longest = max(h[1] for h in table)
    if longest == 0:
        return [None] * world
    padded = torch.zeros(longest, dtype=torch.int32, device=device)
    if message is not None:
        padded[:words].copy_(message)
    gathered = [torch.empty_like(padded) for _ in range(world)]
    _wait(
        dist.all_gather(gathered, padded, group=group, async_op=True),
        timeout,
        "message exchange",
        rank,
    )
    return [m[: h[1]] if h[1] else None for h, m in zip(table, gathered, strict=True)]


def _rank_names(world: int) -> list[str]:
    """How errors name the messages of an exchange, by position."""
    return [f"rank {r}" for r in range(world)]


def _flat_params(params: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    offset = 0
    for p in params:
        n = p.numel()
        out[offset : offset + n].copy_(p.detach().reshape(-1))
        offset += n
    return out


class SharedOptimizer(torch.optim.Optimizer):
    """Wrap any optimizer so that ranks share its threshold-encoded updates (DL4J's mode).

    Each :meth:`step`:

    1. the wrapped optimizer steps locally; the update it made (parameters before minus after)
       is taken out and the parameters are put back exactly;
    2. this rank's :class:`~gradshare.Encoder` adds the update into its residual (one flat
       float32 residual for all parameters) and encodes it;
    3. the messages of all ranks are exchanged (:func:`exchange_messages`), decoded in rank
       order into a zeroed buffer, and every rank steps ``params -= buffer`` (``/ world``
       with ``reduction="mean"``).

    Parameters are broadcast from rank 0 at construction, so the replicas start and stay
    bit-identical; each rank's optimizer state (momentum, Adam moments) is its own. This is the
    same arithmetic as :class:`~gradshare.ParallelWrapper`, so the same data split gives the
    same parameters bit for bit.

    Args:
        optimizer: any ``torch.optim`` optimizer over the model's parameters.
        threshold: the threshold algorithm (cloned; each rank keeps its own state); None
            all-reduces the exact dense updates instead (the oracle to compare with).
        post_processor: residual post-processing.
        process_group: the group to share over (default: the world).
        reduction: ``"sum"`` (DL4J) or ``"mean"`` over ranks.
        timeout: how long a collective may wait for the other ranks before raising.

    Example::

        >>> model = torch.nn.Linear(10, 1)  # doctest: +SKIP
        >>> opt = SharedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))  # doctest: +SKIP
        >>> loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()  # doctest: +SKIP
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        threshold: ThresholdAlgorithm | None = AdaptiveThreshold(1e-3),  # noqa: B008 - cloned
        post_processor: ResidualPostProcessor | None = None,
        process_group: Any = None,
        reduction: Literal["sum", "mean"] = "sum",
        timeout: float | timedelta = timedelta(seconds=300),
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"Expect `optimizer` to be a torch.optim.Optimizer, got {type(optimizer).__name__}."
            )
        if threshold is not None and not isinstance(threshold, ThresholdAlgorithm):
            raise TypeError(
                f"Expect `threshold` to be a ThresholdAlgorithm or None, got "
                f"{type(threshold).__name__}."
            )
        if reduction not in ("sum", "mean"):
            raise ValueError(f'Expect `reduction` "sum" or "mean", got {reduction!r}.')
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "SharedOptimizer needs a process group: call "
                "torch.distributed.init_process_group() first (torchrun sets the environment)."
            )
        self.optim = optimizer
        self.param_groups = optimizer.param_groups
        self.defaults = optimizer.defaults
        self.group = process_group
        self.reduction = reduction
        self.timeout = timedelta(seconds=to_seconds(timeout))
        self.encoder = None if threshold is None else Encoder(threshold.clone(), post_processor)
        """This rank's encoder (None: exact dense updates are all-reduced, the oracle)."""
        self.iteration = 0
        self.bytes_sent = 0
        """Bytes of the messages this rank encoded and sent (headers and padding excluded)."""
        self.last_stats: EncodeStats | None = None
        params = self._params()
        if not params:
            raise ValueError("Expect an optimizer with parameters: there is nothing to share.")
        self.numel = sum(p.numel() for p in params)
        self.device = params[0].device
        self._before = torch.empty(self.numel, dtype=params[0].dtype, device=self.device)
        self._update = torch.empty_like(self._before)
        self._scratch = torch.zeros_like(self._before)
        """Zeros, for :func:`gradshare.codec.subtract_sum_`."""
        self._broadcast_from_rank0(params)

    # ------------------------------------------------------------------ set-up

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    @torch.no_grad()
    def _broadcast_from_rank0(self, params: list[torch.Tensor]) -> None:
        rank = dist.get_rank(self.group)
        exchange_messages(
            None, self.numel, group=self.group, timeout=self.timeout, device=self.device
        )
        flat = _flat_params(params, self._before)
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        work = dist.broadcast(flat, src=src, group=self.group, async_op=True)
        _wait(work, self.timeout, "parameter broadcast", rank)
        self._unflatten(flat, params)

    @staticmethod
    def _unflatten(flat: torch.Tensor, params: list[torch.Tensor]) -> None:
        offset = 0
        for p in params:
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p))
            offset += n

    # ------------------------------------------------------------------ optimizer API

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optim.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError(
            "SharedOptimizer shares one flat vector fixed at construction: build a new one "
            "to add parameters."
        )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Step locally, share the encoded update with every rank, apply the same sum."""
        params = self._params()
        before = _flat_params(params, self._before)
        message: torch.Tensor | None = None
        failure: BaseException | None = None
        loss = None
        try:
            with torch.enable_grad():
                loss = self.optim.step(closure)
            update = torch.sub(before, _flat_params(params, self._update), out=self._update)
            if self.encoder is not None:
                message = self.encoder.encode(update, self.iteration)
                self.last_stats = self.encoder.last_stats
            else:
                codec.check_vector(update, "update")
        except Exception as e:  # tell the other ranks before raising here
            failure = e
        try:
            if self.encoder is None:
                self._dense_step(before, failure)
            else:
                messages = exchange_messages(
                    message,
                    self.numel,
                    group=self.group,
                    timeout=self.timeout,
                    device=self.device,
                    failure=failure,
                )
                codec.subtract_sum_(
                    messages, before, self._scratch, divisor=self._divisor(),
                    names=_rank_names(len(messages)),
                )  # fmt: skip
                self.bytes_sent += 0 if message is None else message.numel() * 4
        finally:  # the parameters before the local step, minus the shared sum if it applied
            self._unflatten(before, params)
        self.iteration += 1
        return loss

    def _divisor(self) -> int:
        return dist.get_world_size(self.group) if self.reduction == "mean" else 1

    def _dense_step(self, before: torch.Tensor, failure: BaseException | None) -> None:
        """The oracle: all-reduce the exact update (after the same status and size check)."""
        exchange_messages(
            None, self.numel, group=self.group, timeout=self.timeout, device=self.device,
            failure=failure,
        )  # fmt: skip
        work = dist.all_reduce(self._update, group=self.group, async_op=True)
        _wait(work, self.timeout, "dense all-reduce", dist.get_rank(self.group))
        before.sub_(self._update.div_(self._divisor()))
        self.bytes_sent += 4 * self.numel

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        """This rank's wrapped optimizer, residual and threshold state: every rank saves its own."""
        return {
            "optimizer": self.optim.state_dict(),
            "encoder": None if self.encoder is None else self.encoder.state_dict(),
            "iteration": self.iteration,
            "bytes_sent": self.bytes_sent,
            "numel": self.numel,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore this rank's :meth:`state_dict`; on a mismatch raise and change nothing."""
        if state_dict.get("numel") != self.numel:
            raise ValueError(
                f"Checkpoint shares {state_dict.get('numel')} elements, this optimizer "
                f"{self.numel}: it is of another model."
            )
        if (state_dict["encoder"] is None) != (self.encoder is None):
            raise ValueError(
                "Checkpoint and optimizer differ in mode (encoded vs dense `threshold=None`)."
            )
        if self.encoder is not None:
            probe = Encoder(self.encoder.algorithm.clone(), self.encoder.post_processor)
            probe.load_state_dict(state_dict["encoder"])
            self.encoder.load_state_dict(state_dict["encoder"])
        self.optim.load_state_dict(state_dict["optimizer"])
        self.iteration = int(state_dict["iteration"])
        self.bytes_sent = int(state_dict["bytes_sent"])

    def __repr__(self) -> str:
        algorithm = None if self.encoder is None else self.encoder.algorithm
        return f"SharedOptimizer({self.optim!r}, threshold={algorithm!r})"
