"""A DDP communication hook that shares threshold-encoded gradients with error feedback.

For users who already train with ``DistributedDataParallel``: register the hook and DDP's
all-reduce of each gradient bucket becomes an exchange of threshold-encoded messages (Strom,
2015). Unlike :class:`~gradshare.SharedOptimizer`, what is encoded is the gradient, not the
optimizer's update, and the hook returns the mean of the decoded gradients, as DDP expects.
"""

from __future__ import annotations

import copy
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gradshare import codec
from gradshare.accumulator import to_seconds
from gradshare.distributed import _wait, exchange_messages
from gradshare.encoder import Encoder
from gradshare.residual import ResidualPostProcessor
from gradshare.threshold import AdaptiveThreshold, ThresholdAlgorithm

__all__ = ["ThresholdHookState", "register_threshold_hook", "threshold_hook"]


class ThresholdHookState:
    """Settings, per-bucket residuals and stats of :func:`threshold_hook`; checkpoints per rank.

    Residuals are keyed by bucket index. DDP rebuilds its buckets once, after the first
    iteration, from the order in which gradients became ready, so a bucket's index can point
    at other parameters in iteration 0 than later. The hook therefore all-reduces exact dense
    gradients for the first ``start_iter`` iterations (at least 1, so no residual is made for a
    bucket that is about to be rebuilt) and encodes from then on; a bucket whose size changes
    after that is an error, not a silent loss of its residual.

    Pickling (``torch.save``) leaves out the process group; every rank saves and restores its
    own residuals with :meth:`state_dict` / :meth:`load_state_dict`.

    Args:
        process_group: the group to share over (default: the world).
        threshold: the threshold algorithm, cloned for each bucket.
        post_processor: residual post-processing (applied per bucket).
        boundary: the most entries a sparse message may carry.
        start_iter: iterations of exact all-reduce before encoding starts (>= 1).
        timeout: how long a collective may wait for the other ranks.
    """

    __slots__ = [  # noqa: RUF023 - grouped as settings / state / stats
        # settings
        "process_group",
        "threshold",
        "post_processor",
        "boundary",
        "start_iter",
        "timeout",
        # state
        "encoders",
        "iteration",
        # stats
        "bytes_sent",
        "dense_bytes",
        "last_stats",
    ]

    def __init__(
        self,
        process_group: Any = None,
        *,
        threshold: ThresholdAlgorithm = AdaptiveThreshold(1e-3),  # noqa: B008 - cloned
        post_processor: ResidualPostProcessor | None = None,
        boundary: int | None = None,
        start_iter: int = 1,
        timeout: float | timedelta = timedelta(seconds=300),
    ) -> None:
        if not isinstance(threshold, ThresholdAlgorithm):
            raise TypeError(
                f"Expect `threshold` to be a ThresholdAlgorithm, got {type(threshold).__name__}."
            )
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 1:
            raise ValueError(
                f"Expect `start_iter` >= 1, got {start_iter!r}, because DDP rebuilds its buckets"
                " after the first iteration and a residual made before would be lost."
            )
        codec.check_boundary(boundary)
        self.process_group = process_group
        self.threshold = threshold
        self.post_processor = post_processor
        self.boundary = boundary
        self.start_iter = start_iter
        self.timeout = timedelta(seconds=to_seconds(timeout))
        self.encoders: dict[int, Encoder] = {}
        self.iteration = 0
        self.bytes_sent = 0
        """Bytes of the messages this rank sent (dense iterations count 4 per element)."""
        self.dense_bytes = 0
        """Bytes the same gradients take dense in float32."""
        self.last_stats: dict[int, Any] = {}

    def encoder(self, bucket_index: int, numel: int) -> Encoder:
        enc = self.encoders.get(bucket_index)
        if enc is None:
            enc = Encoder(self.threshold.clone(), _clone(self.post_processor), self.boundary)
            self.encoders[bucket_index] = enc
        elif enc.residual is not None and enc.residual.numel() != numel:
            raise RuntimeError(
                f"DDP bucket {bucket_index} now holds {numel} elements, its residual "
                f"{enc.residual.numel()}: the buckets were rebuilt after encoding started. "
                "Raise `start_iter` past the rebuild."
            )
        return enc

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        return {
            "iteration": self.iteration,
            "bytes_sent": self.bytes_sent,
            "dense_bytes": self.dense_bytes,
            "encoders": {i: e.state_dict() for i, e in self.encoders.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        encoders = {}
        for i, saved in state["encoders"].items():
            enc = Encoder(self.threshold.clone(), _clone(self.post_processor), self.boundary)
            enc.load_state_dict(saved)
            encoders[int(i)] = enc
        self.encoders = encoders
        self.iteration = int(state["iteration"])
        self.bytes_sent = int(state["bytes_sent"])
        self.dense_bytes = int(state["dense_bytes"])

    def __getstate__(self) -> dict[str, Any]:
        state = {k: getattr(self, k) for k in self.__slots__ if k != "process_group"}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.process_group = None  # the default group of the process that loads it
        for k, v in state.items():
            setattr(self, k, v)


def _clone(post_processor: ResidualPostProcessor | None) -> ResidualPostProcessor | None:
    return copy.deepcopy(post_processor)


def threshold_hook(
    state: ThresholdHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Encode this bucket's gradient with error feedback, exchange, return the decoded mean.

    1. Add the local gradient into the bucket's residual and encode what crossed the
       threshold (sparse indices or a 2-bit bitmap; the rest stays in the residual).
    2. Exchange every rank's message (sizes, then the padded int32 payloads).
    3. Decode them in rank order into a zeroed buffer and divide by the world size.

    Summed over steps, what the hook returns equals the true mean gradients minus the mean of
    the ranks' current residuals. The exchange runs inside the hook, so the result future is
    already complete; the messages are small enough that overlap with backward matters little.

    Example::

        >>> state = ThresholdHookState(threshold=AdaptiveThreshold(1e-3))  # doctest: +SKIP
        >>> ddp_model.register_comm_hook(state, threshold_hook)  # doctest: +SKIP
    """
    grad = bucket.buffer()
    group = state.process_group
    world = dist.get_world_size(group)
    index = bucket.index()
    numel = grad.numel()
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    if state.iteration < state.start_iter:
        out = grad.div(world)
        work = dist.all_reduce(out, group=group, async_op=True)
        _wait(work, state.timeout, "gradient all-reduce", dist.get_rank(group))
        state.bytes_sent += 4 * numel
    else:
        message, failure = None, None
        try:
            enc = state.encoder(index, numel)
            message = enc.encode(grad, state.iteration)
            state.last_stats[index] = enc.last_stats
        except Exception as e:
            failure = e
        messages = exchange_messages(
            message, numel, group=group, timeout=state.timeout, device=grad.device, failure=failure
        )
        total = torch.zeros(numel, dtype=torch.float32, device=grad.device)
        for m in messages:
            if m is not None:
                codec.decode_(m, total)
        out = total.div_(world).to(grad.dtype)
        state.bytes_sent += 0 if message is None else 4 * message.numel()
    state.dense_bytes += 4 * numel
    if bucket.is_last():
        state.iteration += 1
    fut.set_result(out)
    return fut


def register_threshold_hook(
    ddp_model: DistributedDataParallel,
    *,
    threshold: ThresholdAlgorithm = AdaptiveThreshold(1e-3),  # noqa: B008 - cloned
    post_processor: ResidualPostProcessor | None = None,
    boundary: int | None = None,
    start_iter: int = 1,
    timeout: float | timedelta = timedelta(seconds=300),
    process_group: Any = None,
) -> ThresholdHookState:
    """Register :func:`threshold_hook` on ``ddp_model`` and return its state (checkpoint it)."""
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(
            f"Expect a DistributedDataParallel model, got {type(ddp_model).__name__}: wrap it "
            "with torch.nn.parallel.DistributedDataParallel first."
        )
    state = ThresholdHookState(
        process_group,
        threshold=threshold,
        post_processor=post_processor,
        boundary=boundary,
        start_iter=start_iter,
        timeout=timeout,
    )
    ddp_model.register_comm_hook(state, threshold_hook)
    return state
