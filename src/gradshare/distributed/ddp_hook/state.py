"""The hook's state: its settings, per-parameter books and stats, checkpointed per rank."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradshare._checks import check_int
from gradshare.distributed.checkpoint import check_format, check_saved_by, saved_by
from gradshare.distributed.ddp_hook.parameters import Param, ParameterEncoders, Place
from gradshare.distributed.exchange import Pipeline, PrivateGroup
from gradshare.distributed.metrics import Unsent, share_metrics
from gradshare.encoding.encoder import Encoder, EncodeStats
from gradshare.encoding.options import EncodingOptions, encoding_options
from gradshare.encoding.threshold import ThresholdAlgorithm

__all__ = ["FORMAT", "ThresholdHookState"]

logger = logging.getLogger(__name__)

FORMAT = 2
"""The version of :meth:`ThresholdHookState.state_dict` (1: gradshare 0.1, which recorded none;
it reads the same)."""


class ThresholdHookState:
    """Settings, per-parameter residuals, thresholds and velocities, and stats of
    :func:`~gradshare.threshold_hook`; checkpoints per rank.

    Each parameter is named by its place in DDP's first-iteration bucket layout, ``(bucket
    index, position)``: DDP lays its buckets out once from the parameter order (iteration 0 of
    every DDP instance) and rebuilds them after the first iteration from the order in which
    gradients became ready, but the first layout is the same in every process. Each parameter
    gets its own :class:`~gradshare.Encoder` (residual, clone of ``threshold``, clone of
    ``post_processor``) when it first arrives; which bucket it travels in does not matter.
    By default the first iteration all-reduces exact gradients (``start_iter=1``), as the
    PowerSGD hook does.

    Momentum correction (DGC, Lin et al. 2018): with ``momentum=m > 0`` each parameter keeps a
    velocity ``u``; every step ``u = m*u + g``, the residual accumulates ``u`` instead of
    ``g``, and ``u`` is zeroed at every element the message sent (momentum-factor masking).
    The optimizer then runs WITHOUT momentum: ``SGD(params, lr)`` with ``momentum=0.9`` here
    replaces ``SGD(params, lr, momentum=0.9)`` (with error feedback, momentum applied after
    the exchange would be applied to stale, bursty gradients). The ``start_iter`` exact
    iterations all-reduce plain gradients, without momentum.

    Pickling (``torch.save``) leaves out the process group and everything of this process
    (the pipeline's thread, the private group, DDP's layout); every rank saves and restores
    its own residuals, thresholds and velocities with :meth:`state_dict` /
    :meth:`load_state_dict`.

    Args:
        process_group: the group to share over (default: the world).
        start_iter: iterations of exact all-reduce before encoding starts (>= 0).
        momentum: DGC's momentum factor m, ``0 <= m < 1`` (0: none, the plain hook).
        options: the encoding settings (:class:`~gradshare.EncodingOptions`), or give its
            fields as keywords: ``threshold`` (cloned for each parameter), ``post_processor``
            (cloned for each parameter), ``boundary`` (per parameter's message),
            ``magnitude``, ``dense`` (all-reduce exact gradients every iteration: the oracle),
            ``reduction`` (``"mean"`` by default, what DDP expects; ``"sum"`` returns the sum),
            ``timeout`` (how long a collective may wait for the other ranks).
    """

    __slots__ = [  # noqa: RUF023 - grouped as settings / state / stats
        # settings
        "process_group",
        "options",
        "start_iter",
        "momentum",
        # state
        "parameters",
        "iteration",
        "_runtime",
        # stats
        "bytes_sent",
        "dense_bytes",
        "last_stats",
    ]

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        start_iter: int = 1,
        momentum: float = 0.0,
        options: EncodingOptions | None = None,
        **encoding: Any,
    ) -> None:
        self.options = encoding_options(options, encoding, "ThresholdHookState")
        check_int(start_iter, "start_iter", 0)
        _check_momentum(momentum)
        self.process_group = process_group
        self.start_iter = start_iter
        self.momentum = float(momentum)
        self.parameters = ParameterEncoders(self.options, self.momentum)
        """Per parameter: its residual, threshold state and velocity."""
        self.iteration = 0
        self._runtime = _Runtime()
        self.bytes_sent = 0
        """Bytes of the messages this rank sent (exact iterations count 4 per element)."""
        self.dense_bytes = 0
        """Bytes the same gradients take dense in float32."""
        self.last_stats: dict[Place, EncodeStats] = {}
        """Per parameter place: the :class:`~gradshare.EncodeStats` of its last step."""
        if self.options.dense:
            mode = "dense (exact all-reduce every iteration)"
        else:
            mode = f"{self.options.algorithm()} per parameter after {start_iter} exact iteration(s)"
        reduction = self.options.reduce("mean")
        logger.info("threshold hook: %s, momentum %g, reduction %s", mode, momentum, reduction)

    # ------------------------------------------------------------------ settings, read-only

    @property
    def threshold(self) -> ThresholdAlgorithm | None:
        """The threshold algorithm each parameter's encoder clones (a fresh copy; None with
        ``dense=True``)."""
        return self.options.algorithm()

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.options.seconds())

    @property
    def encoders(self) -> dict[Place, Encoder]:
        """Per parameter place: its :class:`~gradshare.Encoder`."""
        return self.parameters.encoders

    @property
    def velocities(self) -> dict[Place, torch.Tensor]:
        """Per parameter place: its float32 velocity (only with ``momentum > 0``)."""
        return self.parameters.velocities

    def divisor(self, world: int) -> int:
        """What the summed decoded gradients are divided by: the world size (``"mean"``)."""
        return world if self.options.reduce("mean") == "mean" else 1

    def settings(self, world: int) -> dict[str, Any]:
        """What every rank must agree on before the first exchange: what changes the sum,
        the wire, or which collective an iteration issues."""
        o = self.options
        settings: dict[str, Any] = {
            "world_size": world,
            "start_iter": self.start_iter,
            "momentum": self.momentum,
            "dense": o.dense,
            "reduction": o.reduce("mean"),
        }
        if not o.dense:
            settings.update(
                threshold=o.algorithm(),
                magnitude=o.magnitude,
                boundary=o.boundary,
                post_processor=o.post_processor,
            )
        return settings

    def end_of_pass(self) -> None:
        """Called by the hook for the last bucket of each iteration."""
        self._runtime.first_pass = False
        self.iteration += 1
        self._runtime.pipeline.clear_failure()

    def metrics(self) -> dict[str, float]:
        """``bytes_sent``, ``dense_bytes``, ``compression``, ``density`` and ``threshold``
        (the mean of the parameters' thresholds) of the last step, and ``stalled`` (the
        parameters that have sent nothing for many steps while holding a residual;
        :func:`~gradshare.distributed.metrics.share_metrics`)."""
        # the last iteration (self.iteration - 1) was encoded if it was at start_iter or after
        encoded = not self.options.dense and self.iteration > self.start_iter
        return share_metrics(
            self.bytes_sent,
            self.dense_bytes,
            self.last_stats.values(),
            encoded=encoded,
            stalled=self._runtime.unsent.stalled(),
        )

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        """This rank's residuals, threshold states and velocities, keyed by parameter place
        (``"bucket,position"``), its counters, the format, and the world size and rank that
        saved them."""
        return {
            "format": FORMAT,
            "iteration": self.iteration,
            "bytes_sent": self.bytes_sent,
            "dense_bytes": self.dense_bytes,
            "momentum": self.momentum,
            **self.parameters.state_dict(),
            **saved_by(self.process_group),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (into a state registered on a fresh DDP model).

        Everything is checked before anything changes: the format, the saving rank and world
        size, every residual and velocity finite and 1-D, a parameter's velocity as long as
        its residual and, for parameters this state has already seen, as long as the
        parameter. A parameter not seen yet is checked when it first arrives.
        """
        if not isinstance(state, dict):
            raise ValueError(f"Expect a hook state dict, got {type(state).__name__}.")
        if "layouts" in state or "loose" in state:
            raise ValueError(
                "Hook state is of an older hook format (residuals per DDP bucket, with "
                "'layouts' and 'loose'): this hook keeps them per parameter and cannot place "
                "those. Resume it with the gradshare version that saved it, or load only the "
                "model and optimizer and let the hook start afresh."
            )
        check_format(state, "Hook state", FORMAT)
        check_saved_by(state, self.process_group, "Hook state")
        missing = {"iteration", "bytes_sent", "dense_bytes", "encoders", "velocities"}
        missing -= set(state)
        if missing:
            raise ValueError(f"Hook state is missing {sorted(missing)}: is it a hook state?")
        counters = {k: state[k] for k in ("iteration", "bytes_sent", "dense_bytes")}
        for name, value in counters.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"Hook state's `{name}` is {value!r}, not an int >= 0: the checkpoint is "
                    "corrupted."
                )
        encoders, velocities = self.parameters.parse(
            state, self._runtime.sizes, state.get("momentum")
        )
        self.parameters.encoders, self.parameters.velocities = encoders, velocities
        self.iteration = counters["iteration"]
        self.bytes_sent = counters["bytes_sent"]
        self.dense_bytes = counters["dense_bytes"]

    def __getstate__(self) -> dict[str, Any]:
        skip = {"process_group", "_runtime"}  # not portable to another process
        return {k: getattr(self, k) for k in self.__slots__ if k not in skip}

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "options" not in state:  # pickled by gradshare 0.1: the settings one by one
            state = _from_0_1(state)
        self.process_group = None  # the default group of the process that loads it
        self._runtime = _Runtime()
        for k, v in state.items():
            setattr(self, k, v)


class _Runtime:
    """What belongs to this process only: DDP's first-iteration layout as seen here, the
    float32 buffers for fp16 buckets, the pipeline's thread and the private group."""

    __slots__ = (
        "agreed",
        "buffers",
        "counted",
        "failure",
        "first_pass",
        "group",
        "keys",
        "pipeline",
        "sizes",
        "unsent",
        "watched",
    )

    def __init__(self) -> None:
        self.keys: dict[int, Place] = {}
        """id(parameter) -> place, in this process."""
        self.sizes: dict[Place, int] = {}
        """place -> numel, of the parameters seen here."""
        self.first_pass = True
        self.buffers: dict[int, torch.Tensor] = {}
        """Per bucket: float32 sums of fp16 gradients."""
        self.pipeline = Pipeline("gradshare-ddp-exchange")
        self.counted = False
        """The ranks on this host are counted (for the kernels' threads)."""
        self.group: PrivateGroup | None = None
        """The private twin of the process group the pipeline's collectives use."""
        self.agreed = False
        """Every rank's settings were found equal (checked at the first exchange)."""
        self.failure: BaseException | None = None
        """The first error of this backward pass's exchanges, for :meth:`raise_failure`."""
        self.watched: list[torch.futures.Future[torch.Tensor]] | None = None
        """This backward pass's futures, while a callback at its end is queued to check them."""
        self.unsent = Unsent("the DDP hook")
        """Per parameter place: the encoded steps in a row it sent nothing (a stat)."""

    def watch(
        self, future: torch.futures.Future[torch.Tensor], grad: torch.Tensor
    ) -> torch.futures.Future[torch.Tensor]:
        """The future to give DDP for a bucket's exchange: one that always completes (with a
        zero gradient when the exchange failed), while a callback queued at the end of this
        backward pass raises the exchange's own error. A failed future would reach the user
        as DDP's ``RuntimeError("Unable to cast ... to Tensor")``, its type lost; an error
        raised in an autograd callback leaves ``backward()`` as it is.

        Outside a backward pass (no autograd engine to queue on) ``future`` is returned as is.
        """
        if self.watched is None:
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self.raise_failure)
            except RuntimeError:
                return future
            self.watched = []

        def keep(done: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            try:
                return done.value()
            except BaseException as e:
                if self.failure is None:
                    self.failure = e
                return grad.zero_()

        out = future.then(keep)
        self.watched.append(out)
        return out

    def raise_failure(self) -> None:
        """At the end of a backward pass: wait for its exchanges, raise the first error."""
        watched, self.watched = self.watched or [], None
        torch.futures.wait_all(watched)
        failure, self.failure = self.failure, None
        if failure is not None:
            raise failure

    def exchange_group(self, state: ThresholdHookState) -> dist.ProcessGroup:
        """The private twin of ``state.process_group`` (made on the first call, from the
        hook, so every rank of the group makes it at the same point)."""
        if self.group is None:
            self.group = PrivateGroup(state.process_group, state.timeout)
        return self.group.get()

    def buffer(self, index: int, like: torch.Tensor) -> torch.Tensor:
        """Bucket ``index``'s float32 buffer for sums of gradients of another dtype."""
        buffer = self.buffers.get(index)
        if buffer is None or buffer.numel() != like.numel() or buffer.device != like.device:
            buffer = self.buffers[index] = torch.empty(like.numel(), device=like.device)
        return buffer

    def params(self, bucket: dist.GradBucket) -> list[Param]:
        """The bucket's parameters, in bucket order, each named by its place (learnt in DDP's
        first iteration in this process); empty ones are left out."""
        params = bucket.parameters()
        if self.first_pass:  # DDP's first iteration in this process: the canonical layout
            for j, p in enumerate(params):
                self.keys[id(p)] = (bucket.index(), j)
        try:
            out = [(self.keys[id(p)], p.numel()) for p in params]
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
        self.sizes.update(out)
        return [(place, n) for place, n in out if n]


def _check_momentum(momentum: Any) -> None:
    ok = isinstance(momentum, (int, float)) and not isinstance(momentum, bool)
    if not (ok and 0 <= momentum < 1):
        raise ValueError(
            f"Expect `momentum` to be a float with 0 <= momentum < 1, got {momentum!r}: it is "
            "DGC's momentum factor m (u = m*u + g); 0 turns momentum correction off, 0.9 is "
            "usual (then run the optimizer without momentum)."
        )


def _from_0_1(old: dict[str, Any]) -> dict[str, Any]:
    """The pickled state of gradshare 0.1 (every setting a slot of its own) in today's form."""
    options = EncodingOptions(
        threshold=old["threshold"],
        post_processor=old["post_processor"],
        boundary=old["boundary"],
        magnitude=old["magnitude"],
        timeout=old["timeout"],
    )
    parameters = ParameterEncoders(options, old["momentum"])
    parameters.encoders, parameters.velocities = old["encoders"], old["velocities"]
    return {
        "options": options,
        "start_iter": old["start_iter"],
        "momentum": old["momentum"],
        "parameters": parameters,
        "iteration": old["iteration"],
        "bytes_sent": old["bytes_sent"],
        "dense_bytes": old["dense_bytes"],
        "last_stats": old["last_stats"],
    }
