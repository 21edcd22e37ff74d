"""A DDP communication hook that shares threshold-encoded gradients with error feedback.

For users who already train with ``DistributedDataParallel``: register the hook and DDP's
all-reduce of each gradient bucket becomes an exchange of threshold-encoded messages (Strom,
2015). Unlike :class:`~gradshare.SharedOptimizer`, what is encoded is the gradient, not the
optimizer's update, and the hook returns the mean of the decoded gradients, as DDP expects.

All state is per parameter: each parameter has its own residual and its own copy of the
threshold algorithm (one threshold per parameter tensor), and, with DGC's momentum correction
(Lin et al., 2018), its own velocity. A bucket is only the list of parameters that travel
together: one message per bucket and rank, the concatenation of its parameters' messages. So
DDP's bucket rebuild after the first iteration changes nothing, and a run resumed from a
checkpoint on a fresh DDP (whose first iteration has another layout) continues bit for bit.

The exchange overlaps with backward, as DDP's own all-reduce does: the hook hands each bucket
to a background :class:`~gradshare.distributed.exchange.Pipeline` and returns at once; the pipeline
encodes, exchanges and decodes the buckets one after the other, in the order they became
ready, over a private twin of the process group (so that its collectives never interleave
with the ones DDP itself issues from the backward thread).
"""

import copy
import functools
import logging
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gradshare import codec
from gradshare._checks import check_int, to_seconds
from gradshare.codec import multipart
from gradshare.codec._flat import slices
from gradshare.distributed.exchange import (
    Pipeline,
    PrivateGroup,
    collective,
    exchange_messages,
    largest_message,
    rank_names,
    take_back,
)
from gradshare.distributed.hosts import count_ranks_on_host
from gradshare.encoding.encoder import Encoder
from gradshare.encoding.residual import ResidualPostProcessor
from gradshare.encoding.threshold import ThresholdAlgorithm, resolve

__all__ = ["ThresholdHookState", "register_threshold_hook", "threshold_hook"]

logger = logging.getLogger(__name__)


Place = tuple[int, int]
"""A parameter's name: its place in DDP's first-iteration buckets (bucket index, position in
it), the same in every process and in every DDP built on the same model."""

Param = tuple[Place, int]
"""A parameter of a bucket: its place and its number of elements."""


class ThresholdHookState:
    """Settings, per-parameter residuals, thresholds and velocities, and stats of
    :func:`threshold_hook`; checkpoints per rank.

    Each parameter is named by its place in DDP's first-iteration bucket layout, ``(bucket
    index, position)``: DDP lays its buckets out once from the parameter order (iteration 0 of
    every DDP instance) and rebuilds them after the first iteration from the order in which
    gradients became ready, but the first layout is the same in every process. Each parameter
    gets its own :class:`~gradshare.encoding.encoder.Encoder` (residual, clone of ``threshold``,
    clone of ``post_processor``) when it first arrives; which bucket it travels in does not matter.
    By default the first iteration all-reduces exact gradients (``start_iter=1``), as the
    PowerSGD hook does.

    Momentum correction (DGC, Lin et al. 2018): with ``momentum=m > 0`` each parameter keeps a
    velocity ``u``; every step ``u = m*u + g``, the residual accumulates ``u`` instead of
    ``g``, and ``u`` is zeroed at every element the message sent (momentum-factor masking).
    The optimizer then runs WITHOUT momentum: ``SGD(params, lr)`` with ``momentum=0.9`` here
    replaces ``SGD(params, lr, momentum=0.9)`` (with error feedback, momentum applied after
    the exchange would be applied to stale, bursty gradients). The ``start_iter`` exact
    iterations all-reduce plain gradients, without momentum.

    Pickling (``torch.save``) leaves out the process group; every rank saves and restores its
    own residuals, thresholds and velocities with :meth:`state_dict` / :meth:`load_state_dict`.

    Args:
        process_group: the group to share over (default: the world).
        threshold: the threshold algorithm, cloned for each parameter (None:
            :func:`gradshare.encoding.threshold.default_threshold`).
        post_processor: residual post-processing, cloned for each parameter.
        boundary: the most entries a parameter's sparse message may carry.
        start_iter: iterations of exact all-reduce before encoding starts (>= 0).
        momentum: DGC's momentum factor m, ``0 <= m < 1`` (0: none, the plain hook).
        magnitude: what each sent entry carries (:class:`~gradshare.Encoder`): ``"threshold"``
            (t, DL4J's encoder) or ``"mean"`` (the mean magnitude of the parameter's sent
            elements, taken out of its residual exactly).
        timeout: how long a collective may wait for the other ranks (default
            :data:`gradshare._checks.DEFAULT_TIMEOUT`).
    """

    __slots__ = [  # noqa: RUF023 - grouped as settings / state / stats
        # settings
        "process_group",
        "threshold",
        "post_processor",
        "boundary",
        "start_iter",
        "momentum",
        "magnitude",
        "timeout",
        # state
        "encoders",
        "velocities",
        "iteration",
        "_keys",
        "_sizes",
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
        momentum: float = 0.0,
        magnitude: Literal["threshold", "mean"] = "threshold",
        timeout: float | timedelta | None = None,
    ) -> None:
        threshold = resolve(threshold)
        codec.check_magnitude(magnitude)
        check_int(start_iter, "start_iter", 0)
        codec.check_boundary(boundary)
        _check_momentum(momentum)
        self.process_group = process_group
        self.threshold = threshold
        self.post_processor = post_processor
        self.boundary = boundary
        self.start_iter = start_iter
        self.momentum = float(momentum)
        self.magnitude = magnitude
        self.timeout = timedelta(seconds=to_seconds(timeout))
        self.encoders: dict[Place, Encoder] = {}
        """Per parameter place: its residual and threshold algorithm."""
        self.velocities: dict[Place, torch.Tensor] = {}
        """Per parameter place: its float32 velocity (only with ``momentum > 0``)."""
        self.iteration = 0
        self._reset_process_local()
        self.bytes_sent = 0
        """Bytes of the messages this rank sent (exact iterations count 4 per element)."""
        self.dense_bytes = 0
        """Bytes the same gradients take dense in float32."""
        self.last_stats: dict[Place, Any] = {}
        """Per parameter place: the :class:`~gradshare.encoding.encoder.EncodeStats` of its last
        step."""

    def _reset_process_local(self) -> None:
        self._keys: dict[int, Place] = {}  # id(parameter) -> place, in this process
        self._sizes: dict[Place, int] = {}  # place -> numel, of the parameters seen here
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
                "threshold hook: %s per parameter, momentum %g, exact all-reduce for %d "
                "iteration(s), exchanges over a private group",
                self.threshold, self.momentum, self.start_iter,
            )  # fmt: skip
        return self._group.get()

    def _buffer(self, index: int, like: torch.Tensor) -> torch.Tensor:
        """Bucket ``index``'s float32 buffer for sums of gradients of another dtype."""
        buffer = self._buffers.get(index)
        if buffer is None or buffer.numel() != like.numel() or buffer.device != like.device:
            buffer = self._buffers[index] = torch.empty(like.numel(), device=like.device)
        return buffer

    def _params(self, bucket: dist.GradBucket) -> list[Param]:
        """The bucket's parameters, in bucket order, each named by its place (learnt in DDP's
        first iteration in this process); empty ones are left out."""
        params = bucket.parameters()
        if self._first_pass:  # DDP's first iteration in this process: the canonical layout
            for j, p in enumerate(params):
                self._keys[id(p)] = (bucket.index(), j)
        try:
            out = [(self._keys[id(p)], p.numel()) for p in params]
        except KeyError:
            raise RuntimeError(
                "The hook met a parameter it did not see in DDP's first iteration: register "
                "one ThresholdHookState per DDP model, on a freshly built DDP."
            ) from None
        if sum(n for _, n in out) != bucket.buffer().numel():
            raise RuntimeError(
                f"Bucket {bucket.index()} holds {bucket.buffer().numel()} elements, its "
                f"parameters {sum(n for _, n in out)}: the hook expects a bucket to be its "
                "parameters' gradients back to back."
            )
        self._sizes.update(out)
        return [(place, n) for place, n in out if n]

    def _encoders(self, params: list[Param], device: torch.device) -> list[Encoder]:
        """The encoders of ``params`` (made on first use), their state on ``device``.

        Every kept residual and velocity is checked against its parameter's size before
        anything changes: a mismatch means the state was restored from another model.
        """
        for place, n in params:
            enc = self.encoders.get(place)
            kept = {"residual": None if enc is None else enc.residual}
            kept["velocity"] = self.velocities.get(place)
            for what, t in kept.items():
                if t is not None and t.numel() != n:
                    raise ValueError(
                        f"The {what} kept for parameter {place} has {t.numel()} elements, the "
                        f"parameter has {n}: the hook state is of another model."
                    )
        out = []
        for place, _ in params:
            enc = self.encoders.get(place)
            if enc is None:
                enc = Encoder(
                self.threshold.clone(), _clone(self.post_processor), self.boundary,
                magnitude=self.magnitude,
            )  # fmt: skip
                self.encoders[place] = enc
            if enc.residual is not None and enc.residual.device != device:
                enc.residual = enc.residual.to(device)  # restored from a checkpoint
            velocity = self.velocities.get(place)
            if velocity is not None and velocity.device != device:
                self.velocities[place] = velocity.to(device)
            out.append(enc)
        return out

    def end_of_pass(self) -> None:
        """Called by the hook for the last bucket of each iteration."""
        self._first_pass = False
        self.iteration += 1
        self._pipeline.clear_failure()

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        """This rank's residuals, threshold states and velocities, keyed by parameter place
        (``"bucket,position"``), its counters, and the world size and rank that saved them."""
        return {
            "iteration": self.iteration,
            "bytes_sent": self.bytes_sent,
            "dense_bytes": self.dense_bytes,
            "momentum": self.momentum,
            "encoders": {_key(p): e.state_dict() for p, e in self.encoders.items()},
            "velocities": {_key(p): u.detach().clone() for p, u in self.velocities.items()},
            **_world_and_rank(self.process_group),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (into a state registered on a fresh DDP model).

        Everything is checked before anything changes: the format, the saving rank and world
        size, every residual and velocity finite and 1-D, a parameter's velocity as long as
        its residual and, for parameters this state has already seen, as long as the
        parameter. A parameter not seen yet is checked when it first arrives.
        """
        if "layouts" in state or "loose" in state:
            raise ValueError(
                "Hook state is of an older hook format (residuals per DDP bucket, with "
                "'layouts' and 'loose'): this hook keeps them per parameter and cannot place "
                "those. Resume it with the gradshare version that saved it, or load only the "
                "model and optimizer and let the hook start afresh."
            )
        here = _world_and_rank(self.process_group)
        saved_at = {k: state.get(k, v) for k, v in here.items()}
        if saved_at != here:
            raise ValueError(
                f"Hook state was saved by rank {saved_at['rank']} of {saved_at['world_size']}, "
                f"this is rank {here['rank']} of {here['world_size']}: each rank loads the "
                "state its own rank saved, in a world of the same size."
            )
        missing = {"iteration", "bytes_sent", "dense_bytes", "encoders", "velocities"}
        missing -= set(state)
        if missing:
            raise ValueError(f"Hook state is missing {sorted(missing)}: is it a hook state?")
        encoders = {}
        for key, saved in state["encoders"].items():
            place = _place(key)
            enc = Encoder(
                self.threshold.clone(), _clone(self.post_processor), self.boundary,
                magnitude=self.magnitude,
            )  # fmt: skip
            enc.load_state_dict(saved)  # refuses a non-finite residual
            if enc.residual is not None:
                _check_size(enc.residual, self._sizes.get(place), "residual", place)
            encoders[place] = enc
        velocities = {}
        for key, u in state["velocities"].items():
            place = _place(key)
            if not isinstance(u, torch.Tensor) or u.dim() != 1 or not u.is_floating_point():
                raise ValueError(f"Hook state's velocity of parameter {place} is not a 1-D "
                                 "floating tensor: the checkpoint is corrupted.")  # fmt: skip
            if not bool(u.isfinite().all()):
                raise ValueError(
                    f"Hook state's velocity of parameter {place} has non-finite values: the "
                    "checkpoint is corrupted; resume from another."
                )
            residual = encoders[place].residual if place in encoders else None
            size = self._sizes.get(place, None if residual is None else residual.numel())
            _check_size(u, size, "velocity", place)
            velocities[place] = u.detach().to(torch.float32).clone()
        if velocities and not self.momentum:
            raise ValueError(
                f"Hook state holds velocities (saved with momentum {state.get('momentum')}), "
                "but this state has `momentum=0`: they would be dropped. Pass the momentum "
                "it was saved with."
            )
        self.encoders, self.velocities = encoders, velocities
        self.iteration = int(state["iteration"])
        self.bytes_sent = int(state["bytes_sent"])
        self.dense_bytes = int(state["dense_bytes"])

    def __getstate__(self) -> dict[str, Any]:
        skip = {
            "process_group",
            "_keys",
            "_sizes",
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


def _check_momentum(momentum: Any) -> None:
    ok = isinstance(momentum, (int, float)) and not isinstance(momentum, bool)
    if not (ok and 0 <= momentum < 1):
        raise ValueError(
            f"Expect `momentum` to be a float with 0 <= momentum < 1, got {momentum!r}: it is "
            "DGC's momentum factor m (u = m*u + g); 0 turns momentum correction off, 0.9 is "
            "usual (then run the optimizer without momentum)."
        )


def _key(place: Place) -> str:
    return f"{place[0]},{place[1]}"


def _place(key: Any) -> Place:
    try:
        b, j = (int(v) for v in str(key).split(","))
    except ValueError:
        raise ValueError(
            f"Hook state names a parameter {key!r}; expect 'bucket,position' (two ints): "
            "the checkpoint is corrupted or of an older hook format."
        ) from None
    return b, j


def _check_size(t: torch.Tensor, size: int | None, what: str, place: Place) -> None:
    if size is not None and t.numel() != size:
        raise ValueError(
            f"Hook state's {what} of parameter {place} has {t.numel()} elements, the parameter "
            f"has {size}: the checkpoint is of another model."
        )


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

    1. check the bucket's gradient is finite, then, per parameter: with momentum ``m``,
       ``u = m*u + g``; add ``u`` (or ``g``) into the parameter's residual and encode what
       crossed its own threshold (sparse indices or a 2-bit bitmap; the rest stays in the
       residual);
    2. concatenate the parameters' messages, in bucket order, into this rank's message (a
       parameter that sends nothing puts an empty sparse header ``[0, N, t, 0]``; a rank
       whose parameters all send nothing sends no message);
    3. exchange every rank's message (sizes, then the padded int32 payloads), checking each
       claimed size against the sum of the parameters' largest valid messages;
    4. cut every rank's message into its pieces by their headers and validate every piece
       whole, then decode each parameter's pieces in rank order into its slice of the bucket
       and divide by the world size (:func:`gradshare.codec.decode_sum_`);
    5. with momentum, zero ``u`` wherever this rank's message moved an element
       (momentum-factor masking), and complete the future.

    So bucket k is exchanged while backward computes bucket k+1. Summed over steps, what the
    hook returns equals the true mean gradients (with momentum: the mean of the ``u``) minus
    the mean of the ranks' current residuals. A rank whose encode fails, or a bad message,
    fails the future on every rank with an error naming the rank, and each rank puts its own
    messages back into its residuals; DDP raises the error from ``backward()``.

    Tuning: the threshold adapts per parameter, so parameters whose gradients differ in scale
    by orders of magnitude each send their own share. With momentum, use ``0.9`` here and an
    optimizer without momentum (see :class:`ThresholdHookState`).

    Example::

        >>> state = ThresholdHookState(threshold=AdaptiveThreshold(1e-3))  # doctest: +SKIP
        >>> ddp_model.register_comm_hook(state, threshold_hook)  # doctest: +SKIP
    """
    grad = bucket.buffer()
    params = state._params(bucket)  # learns the canonical places in the first pass
    group = state._exchange_group()
    job = functools.partial(
        _exchange_bucket, state, group, grad, bucket.index(), params, state.iteration,
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
    params: list[Param],
    iteration: int,
    ready: Any,
) -> torch.Tensor:
    """Steps 1-5 of :func:`threshold_hook` for one bucket (runs in the state's pipeline)."""
    if ready is not None:
        torch.cuda.set_device(grad.device)
        torch.cuda.current_stream().wait_event(ready)
    if not state._counted:
        count_ranks_on_host(group)  # once per process, before any kernel runs
        state._counted = True
    world = dist.get_world_size(group)
    numel = grad.numel()
    if iteration < state.start_iter:
        out = grad.div_(world)
        collective(dist.all_reduce, out, group=group, timeout=state.timeout,
                   what="gradient all-reduce", rank=dist.get_rank(group))  # fmt: skip
        state.bytes_sent += 4 * numel
    else:
        out = _encoded_exchange(state, group, grad, index, params, iteration, world)
    state.dense_bytes += 4 * numel
    if ready is not None:
        torch.cuda.current_stream().synchronize()  # the bucket is final when DDP reads it
    return out


def _encoded_exchange(
    state: ThresholdHookState,
    group: Any,
    grad: torch.Tensor,
    index: int,
    params: list[Param],
    iteration: int,
    world: int,
) -> torch.Tensor:
    sent: list[tuple[torch.Tensor | None, float]] = []  # per parameter, as far as encoded
    mine, failure = None, None
    try:
        _encode_bucket(state, grad, params, iteration, sent)
        mine = _concatenate(sent, params, grad.device)
    except Exception as e:
        failure = e
    # the gradient now lives in the residuals: the bucket takes the mean (float32 sums)
    total = grad if grad.dtype == torch.float32 else state._buffer(index, grad)
    try:
        messages = exchange_messages(
            mine, grad.numel(), group=group, timeout=state.timeout, device=grad.device,
            failure=failure, max_words=sum(largest_message(n) for _, n in params),
        )  # fmt: skip
        names = rank_names(world)
        pieces = [_split(m, params, name) for m, name in zip(messages, names, strict=True)]
        for i, target in enumerate(slices(total, (n for _, n in params))):
            codec.decode_sum_([p[i] for p in pieces], target, divisor=world, names=names,
                              checked=True)  # fmt: skip
    except BaseException:  # this rank's messages go back: nothing of them is lost
        for (place, _), (message, _) in zip(params, sent, strict=False):
            if message is not None:
                take_back(message, state.encoders[place].residual)  # type: ignore[arg-type]
        raise
    if state.momentum:
        for (place, _), (message, _) in zip(params, sent, strict=True):
            if message is not None:
                _mask_(state.velocities[place], message)
    state.bytes_sent += 0 if mine is None else 4 * mine.numel()
    return total if total is grad else grad.copy_(total)


def _encode_bucket(
    state: ThresholdHookState,
    grad: torch.Tensor,
    params: list[Param],
    iteration: int,
    sent: list[tuple[torch.Tensor | None, float]],
) -> None:
    """Step 1: encode each parameter's slice of ``grad``, appending (message, t) to ``sent``."""
    encoders = state._encoders(params, grad.device)  # refuses a state of another model
    bad, first = codec.find_nonfinite(grad)
    if bad:
        raise _nonfinite_error(grad, params, bad, first)
    m = state.momentum
    slices_of_grad = slices(grad, (n for _, n in params))
    for (place, _), enc, g in zip(params, encoders, slices_of_grad, strict=True):
        if m:
            u = state.velocities.get(place)
            u = g.to(torch.float32, copy=True) if u is None else u.mul(m).add_(g)
            message = enc.encode(u, iteration)  # checks u (m*u + g may overflow)
            state.velocities[place] = u
        else:
            message = enc.encode(g, iteration, finite=True)
        assert enc.last_stats is not None
        state.last_stats[place] = enc.last_stats
        sent.append((message, enc.last_stats.threshold))


def _nonfinite_error(grad: torch.Tensor, params: list[Param], bad: int, first: int) -> ValueError:
    """The error for a bucket gradient with ``bad`` non-finite values, the first at ``first``,
    naming the parameter it falls in."""
    offset, place = 0, params[-1][0]
    for p, n in params:
        if first < offset + n:
            place = p
            break
        offset += n
    return ValueError(
        f"The gradient has {bad} non-finite value(s) in this bucket, the first in parameter "
        f"{place} at flat index {first - offset} ({float(grad[first])}): nothing was added "
        "to the residuals. Check the loss or lower the learning rate."
    )


def _concatenate(
    sent: list[tuple[torch.Tensor | None, float]], params: list[Param], device: torch.device
) -> torch.Tensor | None:
    """Step 2: this rank's message, one piece per parameter (None when all are empty)."""
    return multipart.join_messages(
        [m for m, _ in sent], [n for _, n in params], [t for _, t in sent], device
    )


def _split(message: torch.Tensor | None, params: list[Param], name: str) -> list[Any]:
    """Step 4: cut ``name``'s message into one piece per parameter and validate each whole
    (:func:`gradshare.codec.multipart.split_message`); None for a parameter that sent nothing."""
    return multipart.split_message(message, [n for _, n in params], name, [p for p, _ in params])


def _mask_(velocity: torch.Tensor, message: torch.Tensor) -> None:
    """Step 5: zero ``velocity`` wherever ``message`` moves an element (momentum-factor
    masking): a sparse message's indices, a bitmap's set codes (±t and DL4J's -t/2)."""
    if int(message[3]) == codec.FLEXIBLE_ENCODING:
        velocity[message[codec.HEADER_WORDS :].abs().long() - 1] = 0
    else:
        moved = codec.decode_(message, torch.zeros_like(velocity))
        velocity.masked_fill_(moved != 0, 0)


def register_threshold_hook(
    ddp_model: DistributedDataParallel,
    *,
    threshold: ThresholdAlgorithm | None = None,
    post_processor: ResidualPostProcessor | None = None,
    boundary: int | None = None,
    start_iter: int = 1,
    momentum: float = 0.0,
    magnitude: Literal["threshold", "mean"] = "threshold",
    timeout: float | timedelta | None = None,
    process_group: Any = None,
) -> ThresholdHookState:
    """Register :func:`threshold_hook` on ``ddp_model`` and return its state (checkpoint it).

    The keywords are :class:`ThresholdHookState`'s; with ``momentum > 0`` run the optimizer
    without momentum.
    """
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
        momentum=momentum,
        magnitude=magnitude,
        timeout=timeout,
    )
    ddp_model.register_comm_hook(state, threshold_hook)
    return state
