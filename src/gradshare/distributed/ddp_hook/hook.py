"""The hook itself: each bucket's gradient encoded per parameter, exchanged, decoded.

:func:`threshold_hook` hands each bucket to the state's background pipeline and returns a
future at once; the pipeline runs :func:`_exchange_bucket` for the buckets one after the
other, in the order they became ready (the same on every rank).

(No postponed annotations here: DDP compares the hook's bucket annotation with
``dist.GradBucket`` itself.)
"""

import functools
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gradshare import codec
from gradshare.codec import multipart
from gradshare.codec.flat import slices
from gradshare.distributed.agreement import agree
from gradshare.distributed.ddp_hook.parameters import Param
from gradshare.distributed.ddp_hook.state import ThresholdHookState
from gradshare.distributed.exchange import (
    collective,
    exchange_messages,
    exchange_pieces,
    take_back,
)
from gradshare.distributed.hosts import count_ranks_on_host
from gradshare.encoding.options import EncodingOptions
from gradshare.encoding.threshold import sends_whole

__all__ = ["register_threshold_hook", "threshold_hook"]

logger = logging.getLogger(__name__)


def threshold_hook(
    state: ThresholdHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Encode this bucket's gradient with error feedback, exchange, return the decoded mean.

    The hook returns at once with a future; in the background, in the order the buckets
    became ready (every rank the same):

    1. check the bucket's gradient is finite, then, per parameter: with momentum ``m``,
       ``u = m*u + g``; add ``u`` (or ``g``) into the parameter's residual and encode what
       crossed its own threshold (sparse indices or a 2-bit bitmap; the rest stays in the
       residual). A parameter too small for threshold messages (a scalar, a narrow bias:
       :func:`~gradshare.encoding.threshold.sends_whole`) sends all of it, a dense piece;
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
    messages back into its residuals; ``backward()`` raises the original error (its type
    and message: an :class:`~gradshare.ExchangeError`, a ``ValueError``), not DDP's
    ``RuntimeError``. The first exchange of every process first checks that every rank's
    hook settings agree (:func:`~gradshare.distributed.agreement.agree`), and every exchange
    carries the iteration, so ranks at different iterations (a stale checkpoint) raise the
    same error instead of averaging different steps.

    Tuning: the threshold adapts per parameter, so parameters whose gradients differ in scale
    by orders of magnitude each send their own share. With momentum, use ``0.9`` here and an
    optimizer without momentum (see :class:`ThresholdHookState`).

    Example::

        >>> state = ThresholdHookState(threshold=AdaptiveThreshold(1e-3))  # doctest: +SKIP
        >>> ddp_model.register_comm_hook(state, threshold_hook)  # doctest: +SKIP
    """
    grad = bucket.buffer()
    params = state._runtime.params(bucket)  # learns the canonical places in the first pass
    group = state._runtime.exchange_group(state)
    index, iteration, ready = bucket.index(), state.iteration, _ready_event(grad)
    job = functools.partial(_exchange_bucket, state, group, grad, index, params, iteration, ready)
    future = state._runtime.watch(state._runtime.pipeline.submit(job), grad)
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
    group: dist.ProcessGroup,
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
    if not state._runtime.counted:
        count_ranks_on_host(group)  # once per process, before any kernel runs
        state._runtime.counted = True
    world = dist.get_world_size(group)
    numel = grad.numel()
    if not state._runtime.agreed:  # every rank's first exchange in this process
        agree(
            state.settings(world),
            group=group,
            timeout=state.timeout,
            what="ThresholdHookState (the DDP hook)",
            device=grad.device,
        )
        state._runtime.agreed = True
    sent_before = state.bytes_sent
    if iteration < state.start_iter or state.options.dense:
        # the same header as an encoded exchange first: ranks at different iterations (one
        # encoding, one all-reducing) meet in the same collective and raise alike
        exchange_messages(
            None, numel, group=group, timeout=state.timeout, device=grad.device, round=iteration
        )
        out = grad.div_(state.divisor(world))
        collective(
            dist.all_reduce,
            out,
            group=group,
            timeout=state.timeout,
            what="gradient all-reduce",
            rank=dist.get_rank(),
        )
        state.bytes_sent += 4 * numel
    else:
        out = _encoded_exchange(state, group, grad, index, params, iteration, world)
    sent = state.bytes_sent - sent_before
    logger.debug("threshold hook: iteration %d, bucket %d sent %d bytes", iteration, index, sent)
    state.dense_bytes += 4 * numel
    if ready is not None:
        torch.cuda.current_stream().synchronize()  # the bucket is final when DDP reads it
    return out


def _encoded_exchange(
    state: ThresholdHookState,
    group: dist.ProcessGroup,
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
    total = grad if grad.dtype == torch.float32 else state._runtime.buffer(index, grad)
    try:
        sent_bytes = exchange_pieces(
            mine,
            list(slices(total, (n for _, n in params))),
            [place for place, _ in params],
            group=group,
            timeout=state.timeout,
            device=grad.device,
            divisor=state.divisor(world),
            failure=failure,
            round=iteration,
        )
    except BaseException:  # this rank's messages go back: nothing of them is lost
        for (place, _), (message, _) in zip(params, sent, strict=False):
            if message is not None:
                take_back(message, state.encoders[place].residual)  # type: ignore[arg-type]
        raise
    if state.momentum:
        for (place, _), (message, _) in zip(params, sent, strict=True):
            if message is not None:
                _mask_(state.velocities[place], message)
    state.bytes_sent += sent_bytes
    return total if total is grad else grad.copy_(total)


def _encode_bucket(
    state: ThresholdHookState,
    grad: torch.Tensor,
    params: list[Param],
    iteration: int,
    sent: list[tuple[torch.Tensor | None, float]],
) -> None:
    """Step 1: encode each parameter's slice of ``grad``, appending (message, t) to ``sent``."""
    encoders = state.parameters.for_params(params, grad.device)  # refuses a state of another model
    bad, first = codec.find_nonfinite(grad)
    if bad:
        raise _nonfinite_error(grad, params, bad, first)
    m = state.momentum
    slices_of_grad = slices(grad, (n for _, n in params))
    for (place, n), enc, g in zip(params, encoders, slices_of_grad, strict=True):
        whole = sends_whole(enc.algorithm, n)  # too small for a threshold message
        if m:
            u = state.velocities.get(place)
            u = g.to(torch.float32, copy=True) if u is None else u.mul(m).add_(g)
            # either checks u (m*u + g may overflow)
            message = enc.encode_whole(u, iteration) if whole else enc.encode(u, iteration)
            state.velocities[place] = u
        elif whole:
            message = enc.encode_whole(g, iteration)
        else:
            message = enc.encode(g, iteration, finite=True)
        assert enc.last_stats is not None
        state.last_stats[place] = enc.last_stats
        state._runtime.unsent.count(place, enc.last_stats)
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


def _mask_(velocity: torch.Tensor, message: torch.Tensor) -> None:
    """Step 5: zero ``velocity`` wherever ``message`` moves an element (momentum-factor
    masking): a sparse message's indices, a bitmap's set codes (±t and DL4J's -t/2). A dense
    piece holds nothing back, so its velocity is kept whole: momentum SGD on the mean."""
    if int(message[3]) == codec.DENSE_ENCODING:
        return
    if int(message[3]) == codec.FLEXIBLE_ENCODING:
        velocity[message[codec.HEADER_WORDS :].abs().long() - 1] = 0
    else:
        moved = codec.decode_(message, torch.zeros_like(velocity))
        velocity.masked_fill_(moved != 0, 0)


def register_threshold_hook(
    ddp_model: DistributedDataParallel,
    *,
    process_group: dist.ProcessGroup | None = None,
    start_iter: int = 1,
    momentum: float = 0.0,
    options: EncodingOptions | None = None,
    **encoding: Any,
) -> ThresholdHookState:
    """Register :func:`threshold_hook` on ``ddp_model`` and return its state (checkpoint it).

    The keywords are :class:`ThresholdHookState`'s (the :class:`~gradshare.EncodingOptions`
    fields among them); with ``momentum > 0`` run the optimizer without momentum.
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(
            f"Expect a DistributedDataParallel model, got {type(ddp_model).__name__}: wrap it "
            "with torch.nn.parallel.DistributedDataParallel first."
        )
    state = ThresholdHookState(
        process_group, start_iter=start_iter, momentum=momentum, options=options, **encoding
    )
    ddp_model.register_comm_hook(state, threshold_hook)
    return state
