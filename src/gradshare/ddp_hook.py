"""A DDP communication hook that shares threshold-encoded gradients with error feedback.

For users who already train with ``DistributedDataParallel``: register the hook and DDP's
all-reduce of each gradient bucket becomes an exchange of threshold-encoded messages (Strom,
2015). Unlike :class:`~gradshare.SharedOptimizer`, what is encoded is the gradient, not the
optimizer's update, and the hook returns the mean of the decoded gradients, as DDP expects.

The exchange overlaps with backward, as DDP's own all-reduce does: the hook hands each bucket
to a background :class:`~gradshare.exchange.Pipeline` and returns at once; the pipeline
encodes, exchanges and decodes the buckets one after the other, in the order they became
ready, over a private twin of the process group (so that its collectives never interleave
with the ones DDP itself issues from the backward thread).
"""

import copy
import functools
import logging
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gradshare import codec, threads
from gradshare._checks import check_int
from gradshare.accumulator import to_seconds
from gradshare.encoder import Encoder
from gradshare.exchange import (
    Pipeline,
    PrivateGroup,
    exchange_messages,
    rank_names,
    take_back,
    wait,
)
from gradshare.residual import ResidualPostProcessor
from gradshare.threshold import ThresholdAlgorithm, resolve

__all__ = ["ThresholdHookState", "register_threshold_hook", "threshold_hook"]

logger = logging.getLogger(__name__)


Slot = tuple[int, int, int]
"""A parameter in a bucket's residual: its place in DDP's first-iteration buckets (bucket
index, position in it), which is the same in every process, and its number of elements."""


class ThresholdHookState:
    """Settings, per-bucket residuals and stats of :func:`threshold_hook`; checkpoints per rank.

    How DDP's bucket rebuild is handled: DDP lays its buckets out once from the parameter order
    (iteration 0 of every DDP instance), then rebuilds them after the first iteration from the
    order in which gradients became ready. Each parameter is therefore named by its place in
    the first-iteration layout, ``(bucket index, position)``, which is the same in every
    process, and each bucket's residual records the parameters it holds, in order. When a
    bucket arrives with another layout (the rebuild, or a restored checkpoint meeting a fresh
    DDP's first iteration), its residual is reassembled parameter by parameter from wherever
    those parameters' residuals are: nothing is lost and a resumed run continues bit for bit.
    By default the first iteration all-reduces exact gradients (``start_iter=1``), as the
    PowerSGD hook does.

    Pickling (``torch.save``) leaves out the process group; every rank saves and restores its
    own residuals with :meth:`state_dict` / :meth:`load_state_dict`.

    Args:
        process_group: the group to share over (default: the world).
        threshold: the threshold algorithm, cloned for each bucket (None:
            :func:`gradshare.threshold.default_threshold`).
        post_processor: residual post-processing (applied per bucket).
        boundary: the most entries a sparse message may carry.
        start_iter: iterations of exact all-reduce before encoding starts (>= 0).
        timeout: how long a collective may wait for the other ranks (default
            :data:`gradshare.accumulator.DEFAULT_TIMEOUT`).
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
        "layouts",
        "loose",
        "iteration",
        "_keys",
        "_first_pass",
        "_buffers",
        "_pipeline",
        "_group",
        "_counted",
        # stats
        "bytes_sent",
        "dense_bytes",
        "last_stats",
    ]

    def __init__(
        self,
        process_group: Any = None,
        *,
        threshold: ThresholdAlgorithm | None = None,
        post_processor: ResidualPostProcessor | None = None,
        boundary: int | None = None,
        start_iter: int = 1,
        timeout: float | timedelta | None = None,
    ) -> None:
        threshold = resolve(threshold)
        check_int(start_iter, "start_iter", 0)
        codec.check_boundary(boundary)
        self.process_group = process_group
        self.threshold = threshold
        self.post_processor = post_processor
        self.boundary = boundary
        self.start_iter = start_iter
        self.timeout = timedelta(seconds=to_seconds(timeout))
        self.encoders: dict[int, Encoder] = {}
        self.layouts: dict[int, list[Slot]] = {}
        """Per bucket index, the parameters its residual holds, in order."""
        self.loose: dict[tuple[int, int], torch.Tensor] = {}
        """Residuals of parameters between two layouts (during a rebuild)."""
        self.iteration = 0
        self._reset_process_local()
        self.bytes_sent = 0
        """Bytes of the messages this rank sent (exact iterations count 4 per element)."""
        self.dense_bytes = 0
        """Bytes the same gradients take dense in float32."""
        self.last_stats: dict[int, Any] = {}

    def _reset_process_local(self) -> None:
        self._keys: dict[int, tuple[int, int]] = {}  # id(parameter) -> place, this process
        self._first_pass = True
        self._buffers: dict[int, torch.Tensor] = {}  # per bucket: float32 sums of fp16 grads
        self._pipeline = Pipeline("gradshare-ddp-exchange")
        self._counted = False  # the ranks on this host are counted (for the kernels' threads)
        self._group: PrivateGroup | None = None
        """The private twin of ``process_group`` the pipeline's collectives use."""

    def _exchange_group(self) -> Any:
        """The private twin of ``process_group`` the pipeline's collectives use (made on the
        first call, from the hook, so every rank of the group makes it at the same point)."""
        if self._group is None:
            self._group = PrivateGroup(self.process_group, self.timeout)
            logger.info(
                "threshold hook: %s, exact all-reduce for %d iteration(s), exchanges over a "
                "private group", self.threshold, self.start_iter,
            )  # fmt: skip
        return self._group.get()

    def _buffer(self, index: int, like: torch.Tensor) -> torch.Tensor:
        """Bucket ``index``'s float32 buffer for sums of gradients of another dtype."""
        buffer = self._buffers.get(index)
        if buffer is None or buffer.numel() != like.numel() or buffer.device != like.device:
            buffer = self._buffers[index] = torch.empty(like.numel(), device=like.device)
        return buffer

    def _layout(self, bucket: dist.GradBucket) -> list[Slot]:
        params = bucket.parameters()
        if self._first_pass:  # DDP's first iteration in this process: the canonical layout
            for j, p in enumerate(params):
                self._keys[id(p)] = (bucket.index(), j)
        try:
            return [(*self._keys[id(p)], p.numel()) for p in params]
        except KeyError:
            raise RuntimeError(
                "The hook met a parameter it did not see in DDP's first iteration: register "
                "one ThresholdHookState per DDP model, on a freshly built DDP."
            ) from None

    def _encoder(self, index: int, layout: list[Slot], device: torch.device) -> Encoder:
        """The encoder of bucket ``index``, its residual laid out as ``layout``."""
        enc = self.encoders.get(index)
        if enc is None:
            enc = Encoder(self.threshold.clone(), _clone(self.post_processor), self.boundary)
            self.encoders[index] = enc
        if self.layouts.get(index) != layout:
            self._relayout(index, layout, device)
        return enc

    def _relayout(self, index: int, layout: list[Slot], device: torch.device) -> None:
        """Reassemble bucket ``index``'s residual for ``layout``, parameter by parameter.

        Every residual holding one of the wanted parameters, and the bucket's own previous
        one whatever it holds, is taken apart into per-parameter pieces first; the pieces not
        wanted here wait in ``loose`` for their parameters' new bucket.
        """
        sizes = {(b, j): n for slots in self.layouts.values() for b, j, n in slots}
        sizes.update({key: piece.numel() for key, piece in self.loose.items()})
        for b, j, n in layout:  # refuse before anything moves
            if sizes.get((b, j), n) != n:
                raise ValueError(
                    f"The residual kept for parameter ({b}, {j}) has {sizes[(b, j)]} elements, "
                    f"the parameter now has {n}: the hook state is of another model."
                )
        wanted = {slot[:2] for slot in layout}
        for i, slots in list(self.layouts.items()):
            if i != index and wanted.isdisjoint(slot[:2] for slot in slots):
                continue
            residual, offset = self.encoders[i].residual, 0
            for b, j, n in slots:
                if residual is not None:
                    self.loose[(b, j)] = residual[offset : offset + n].clone()
                offset += n
            self.encoders[i].residual = None
            del self.layouts[i]
        pieces = [self.loose.pop((b, j), None) for b, j, _ in layout]
        if any(piece is not None for piece in pieces):
            self.encoders[index].residual = torch.cat(
                [
                    torch.zeros(n, device=device) if piece is None else piece.to(device)
                    for piece, (_, _, n) in zip(pieces, layout, strict=True)
                ]
            )
        self.layouts[index] = layout

    def end_of_pass(self) -> None:
        """Called by the hook for the last bucket of each iteration."""
        self._first_pass = False
        self.iteration += 1
        self._pipeline.clear_failure()

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        """This rank's residuals (with their layouts), threshold states, counters, and the
        world size and rank that saved them."""
        return {
            "iteration": self.iteration,
            "bytes_sent": self.bytes_sent,
            "dense_bytes": self.dense_bytes,
            "encoders": {i: e.state_dict() for i, e in self.encoders.items()},
            "layouts": {i: [list(slot) for slot in slots] for i, slots in self.layouts.items()},
            "loose": {f"{b},{j}": t.clone() for (b, j), t in self.loose.items()},
            **_world_and_rank(self.process_group),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (into a state registered on a fresh DDP model).

        Everything is checked before anything changes: the saving rank and world size, each
        residual against its layout, every piece finite. A parameter whose size differs from
        the saved piece is refused when its bucket first arrives (the checkpoint is of
        another model).
        """
        here = _world_and_rank(self.process_group)
        saved_at = {k: state.get(k, v) for k, v in here.items()}
        if saved_at != here:
            raise ValueError(
                f"Hook state was saved by rank {saved_at['rank']} of {saved_at['world_size']}, "
                f"this is rank {here['rank']} of {here['world_size']}: each rank loads the "
                "state its own rank saved, in a world of the same size."
            )
        layouts = {
            int(i): [(int(b), int(j), int(n)) for b, j, n in slots]
            for i, slots in state["layouts"].items()
        }
        encoders = {}
        for i, saved in state["encoders"].items():
            enc = Encoder(self.threshold.clone(), _clone(self.post_processor), self.boundary)
            enc.load_state_dict(saved)  # refuses a non-finite residual
            size = sum(n for _, _, n in layouts.get(int(i), []))
            if enc.residual is not None and enc.residual.numel() != size:
                raise ValueError(
                    f"Hook state of bucket {i} holds a residual of {enc.residual.numel()} "
                    f"elements for parameters of {size}: the checkpoint is corrupted."
                )
            encoders[int(i)] = enc
        loose = {}
        for key, t in state["loose"].items():
            b, j = key.split(",")
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or not bool(t.isfinite().all()):
                raise ValueError(f"Hook state's residual of parameter {key} is not finite 1-D.")
            loose[(int(b), int(j))] = t.clone()
        self.encoders, self.layouts, self.loose = encoders, layouts, loose
        self.iteration = int(state["iteration"])
        self.bytes_sent = int(state["bytes_sent"])
        self.dense_bytes = int(state["dense_bytes"])

    def __getstate__(self) -> dict[str, Any]:
        skip = {
            "process_group",
            "_keys",
            "_first_pass",
            "_buffers",
            "_pipeline",
            "_group",
            "_counted",
        }  # not portable to another process
        return {k: getattr(self, k) for k in self.__slots__ if k not in skip}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.process_group = None  # the default group of the process that loads it
        self._reset_process_local()
        for k, v in state.items():
            setattr(self, k, v)


def _world_and_rank(group: Any) -> dict[str, int]:
    if not dist.is_initialized():
        return {}
    return {"world_size": dist.get_world_size(group), "rank": dist.get_rank(group)}


def _clone(post_processor: ResidualPostProcessor | None) -> ResidualPostProcessor | None:
    return copy.deepcopy(post_processor)


def threshold_hook(
    state: ThresholdHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Encode this bucket's gradient with error feedback, exchange, return the decoded mean.

    The hook returns at once with a future; in the background, in the order the buckets
    became ready (every rank the same):

    1. add the local gradient into the bucket's residual and encode what crossed the
       threshold (sparse indices or a 2-bit bitmap; the rest stays in the residual);
    2. exchange every rank's message (sizes, then the padded int32 payloads), checking each
       claimed size against the largest valid message;
    3. validate every message whole, then decode them in rank order into the bucket and
       divide by the world size (one fused pass: :func:`gradshare.codec.decode_sum_`), and
       complete the future.

    So bucket k is exchanged while backward computes bucket k+1. Summed over steps, what the
    hook returns equals the true mean gradients minus the mean of the ranks' current
    residuals. A rank whose encode fails, or a bad message, fails the future on every rank
    with an error naming the rank; DDP raises it from ``backward()``.

    Example::

        >>> state = ThresholdHookState(threshold=AdaptiveThreshold(1e-3))  # doctest: +SKIP
        >>> ddp_model.register_comm_hook(state, threshold_hook)  # doctest: +SKIP
    """
    grad = bucket.buffer()
    layout = state._layout(bucket)  # learns the canonical layout in the first pass
    group = state._exchange_group()
    job = functools.partial(
        _exchange_bucket, state, group, grad, bucket.index(), layout, state.iteration,
        _ready_event(grad),
    )  # fmt: skip
    future = state._pipeline.submit(job)
    if state.iteration == state.start_iter and bucket.index() == 0 and state.start_iter:
        logger.info("threshold hook: encoding from iteration %d on", state.iteration)
    if bucket.is_last():
        state.end_of_pass()
    return future


def _ready_event(grad: torch.Tensor) -> Any:
    """On CUDA, an event on the stream that produced ``grad`` (the pipeline waits for it)."""
    if not grad.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def _exchange_bucket(
    state: ThresholdHookState,
    group: Any,
    grad: torch.Tensor,
    index: int,
    layout: list[Slot],
    iteration: int,
    ready: Any,
) -> torch.Tensor:
    """Steps 1-3 of :func:`threshold_hook` for one bucket (runs in the state's pipeline)."""
    if ready is not None:
        torch.cuda.set_device(grad.device)
        torch.cuda.current_stream().wait_event(ready)
    if not state._counted:
        threads.count_ranks_on_host(group)  # once per process, before any kernel runs
        state._counted = True
    world = dist.get_world_size(group)
    numel = grad.numel()
    if iteration < state.start_iter:
        out = grad.div_(world)
        work = dist.all_reduce(out, group=group, async_op=True)
        wait(work, state.timeout, "gradient all-reduce", dist.get_rank(group))
        state.bytes_sent += 4 * numel
    else:
        message, failure = None, None
        try:
            enc = state._encoder(index, layout, grad.device)
            message = enc.encode(grad, iteration)
            state.last_stats[index] = enc.last_stats
        except Exception as e:
            failure = e
        # the gradient now lives in the residual: its buffer takes the mean (float32 sums)
        total = grad if grad.dtype == torch.float32 else state._buffer(index, grad)
        try:
            messages = exchange_messages(
                message, numel, group=group, timeout=state.timeout, device=grad.device,
                failure=failure,
            )  # fmt: skip
            codec.decode_sum_(messages, total, divisor=world, names=rank_names(world))
        except BaseException:  # this rank's message goes back: nothing of it is lost
            if message is not None:
                take_back(message, state.encoders[index].residual)  # type: ignore[arg-type]
            raise
        out = total if total is grad else grad.copy_(total)
        state.bytes_sent += 0 if message is None else 4 * message.numel()
    state.dense_bytes += 4 * numel
    if ready is not None:
        torch.cuda.current_stream().synchronize()  # the bucket is final when DDP reads it
    return out


def register_threshold_hook(
    ddp_model: DistributedDataParallel,
    *,
    threshold: ThresholdAlgorithm | None = None,
    post_processor: ResidualPostProcessor | None = None,
    boundary: int | None = None,
    start_iter: int = 1,
    timeout: float | timedelta | None = None,
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
