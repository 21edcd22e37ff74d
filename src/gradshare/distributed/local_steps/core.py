"""The :class:`LocalSteps` class: it validates, builds the fragments, hooks the inner
optimizer, counts, and runs each round's steps in order (the package's docstring tells the
algorithm)."""

from __future__ import annotations

import logging
import sys
import time
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# Imported before any process group exists (see gradshare.distributed for why).
import torch.distributed.nn.functional

from gradshare.distributed.agreement import agree
from gradshare.distributed.buffers import BufferSync
from gradshare.distributed.exchange import PrivateGroup
from gradshare.distributed.local_steps import state as state_io
from gradshare.distributed.local_steps.elastic import Elastic, Member, join
from gradshare.distributed.local_steps.elastic import sync as elastic_sync
from gradshare.distributed.local_steps.fragment import (
    Buffers,
    Fragment,
    OuterStepError,
    build_fragments,
)
from gradshare.distributed.local_steps.options import (
    LocalStepsOptions,
    local_steps_options,
    outer_factory,
)
from gradshare.distributed.local_steps.overlap import Overlap
from gradshare.distributed.local_steps.protocol import Protocol, undone_on_error
from gradshare.distributed.local_steps.resize import load_resized
from gradshare.distributed.local_steps.schedule import Schedule
from gradshare.distributed.metrics import Unsent, share_metrics
from gradshare.encoding.encoder import Encoder
from gradshare.encoding.options import FIELDS as ENCODING_FIELDS
from gradshare.encoding.options import EncodingOptions, encoding_options
from gradshare.encoding.threshold import QuantileThreshold, ThresholdAlgorithm, sends_whole

__all__ = ["LocalSteps"]

logger = logging.getLogger(__name__)

_SYNCED: weakref.WeakKeyDictionary[torch.optim.Optimizer, None] = weakref.WeakKeyDictionary()
"""The inner optimizers a LocalSteps hooks now (until its :meth:`~LocalSteps.close`)."""


class LocalSteps:
    """Sync replicas every ``sync_every`` inner steps with sparse, error-feedback messages.

    Each rank trains its own replica; every ``sync_every``-th ``inner_optimizer.step()`` ends
    with a sync of every parameter (of one fragment with ``fragments``), on every rank: Δ =
    global copy - replica goes into each parameter's residual (residual = β·residual + Δ);
    the residual is threshold-encoded (``QuantileThreshold(density)``; a 1-element
    parameter whole); the ranks' messages are exchanged and validated whole, their decoded
    mean steps the global copy with the outer optimizer, and the model takes the global
    copy. The replicas' parameters and buffers are then bit-identical; what was not sent
    waits in the residual. :mod:`gradshare.distributed.local_steps` tells every step, the
    overlap (``overlap=τ``: the exchange runs during the next τ steps) and the fragments.

    Args:
        model: this rank's replica (not wrapped in DistributedDataParallel). Rank 0's
            parameters and buffers are broadcast at construction.
        inner_optimizer: the optimizer the training loop steps (its ``step`` is hooked).
        sync_every: H, inner steps between syncs (:class:`LocalStepsOptions`).
        local: the LocalSteps options (:class:`LocalStepsOptions`), or give its fields as
            keywords: ``density``, ``decay``, ``outer_optimizer``, ``offload``, ``overlap``,
            ``fragments``, ``compact``, ``broadcast_buffers``.
        grad_scaler: the run's ``torch.amp.GradScaler``: iterations are then counted by
            its ``update()``, so a rank whose step it skipped still syncs with the others (a
            scaler not passed is refused at the first step).
        group: the process group (default: the world).
        options: the encoding settings (:class:`~gradshare.EncodingOptions`), or give its
            fields as keywords: ``threshold`` (instead of ``QuantileThreshold(density)``,
            cloned per parameter), ``post_processor``, ``boundary``, ``magnitude``,
            ``dense`` (exact float32 syncs: DiLoCo), ``reduction`` (``"mean"`` by default),
            ``timeout`` (how long a sync waits for the other ranks).

    Example::

        >>> inner = torch.optim.AdamW(model.parameters(), lr=1e-3)  # doctest: +SKIP
        >>> with LocalSteps(model, inner, sync_every=10) as sync:  # doctest: +SKIP
        ...     for x, y in loader:
        ...         inner.zero_grad(); loss_fn(model(x), y).backward(); inner.step()
    """

    def __init__(
        self,
        model: torch.nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        sync_every: int | None = None,
        *,
        local: LocalStepsOptions | None = None,
        grad_scaler: Any = None,
        group: dist.ProcessGroup | None = None,
        elastic: Elastic | None = None,
        options: EncodingOptions | None = None,
        **fields: Any,
    ) -> None:
        own = {k: fields.pop(k) for k in list(fields) if k not in ENCODING_FIELDS}
        if sync_every is not None:
            own["sync_every"] = sync_every
        self.local = local_steps_options(local, own, "LocalSteps")
        self.options = encoding_options(options, fields, "LocalSteps")
        o, threshold = self.local, self.options.threshold
        self.dense = self.options.dense or (threshold is None and o.density == 1.0)
        _check_arguments(model, inner_optimizer, grad_scaler, o, threshold, self.dense, elastic)
        # settings
        self.sync_every, self.decay, self.compact = o.sync_every, float(o.decay), o.compact
        self.density = None if threshold is not None else 1.0 if self.dense else float(o.density)
        self.overlap = o.tau
        """τ: the inner steps each round's exchange runs in the background (0: no overlap)."""
        self.fragments = o.fragments
        self.offload = o.offload
        self.group, self.model, self.inner = group, model, inner_optimizer
        self.names = [name for name, _ in model.named_parameters()]
        self.params = [p for _, p in model.named_parameters()]
        self.numel = sum(p.numel() for p in self.params)
        self.device = self.params[0].device
        """Where the collectives run (the model's device)."""
        self.home = torch.device("cpu") if o.offload else self.device
        """Where the global copy, residuals and outer state live."""
        self.timeout = timedelta(seconds=self.options.seconds())
        self._private = PrivateGroup(group, self.timeout) if elastic is None else (
            Member(elastic, self)
        )  # fmt: skip
        synced = model if o.broadcast_buffers else torch.nn.Module()
        buffers = BufferSync(synced, self._private, self.device)
        mean = self.options.reduce("mean") == "mean"
        self._protocol = Protocol(self._private, group, self.device, self.names, buffers, mean)
        sizes = [p.numel() for p in self.params]
        self._schedule = Schedule(sizes, o.sync_every, o.fragments, o.tau)
        self._outer_factory = outer_factory(o, inner_optimizer)
        self._outer_text = _optimizer_text(self._outer_factory([torch.zeros(1)]))
        self._scaler = grad_scaler
        self._unsent = Unsent("LocalSteps")
        self._broken: str | None = None
        """Why syncing stopped for good (an outer step that overflowed), or None."""
        # counters and stats
        self.steps = 0
        """Inner iterations counted (steps, or ``update()`` calls with a grad scaler)."""
        self.syncs = 0
        """Syncs completed (with ``overlap``: started): the round number of the next one."""
        self.bytes_sent = 0
        """Bytes of the messages this rank sent (dense syncs: 4 per element)."""
        self.dense_bytes = 0
        """Bytes the same syncs take sent dense in float32."""
        self.sync_seconds = 0.0
        """Wall seconds the loop spent in syncs and merges (waits included; not saved)."""
        self.wait_seconds = 0.0
        """Wall seconds spent waiting for an exchange in flight (``overlap``; not saved)."""
        self.left = False  # this rank left the quorum (Elastic.leave): it syncs no more
        if elastic is None:  # every rank alike, then rank 0's parameters and buffers
            _agree_and_broadcast(self, buffers)
        self.global_params = [
            p.detach().to(self.home, torch.promote_types(p.dtype, torch.float32), copy=True)
            for p in self.params
        ]
        """The global copy: the parameters every replica starts each round from (float32
        at least, so that small outer steps are not rounded away)."""
        self.outer = self._outer_factory(self.global_params)
        self.encoders: list[Encoder] = [self._new_encoder() for _ in self.params if not self.dense]
        """Per parameter: its residual and threshold state (none for dense syncs)."""
        self._fragments, self._flat, self._overlap = _build_rounds(self)
        self._handle = _hook(self, inner_optimizer, grad_scaler)
        if isinstance(self._private, Member):  # the first quorum, and the sync it is at
            join(self, self._private)
        built = "%r: %d parameter tensors, %d elements, world %d"
        logger.info(built, self, len(self.params), self.numel, self._protocol.world)

    # ------------------------------------------------------------------ set-up

    def _algorithm(self) -> ThresholdAlgorithm:
        if self.options.threshold is not None:
            return self.options.threshold.clone()
        assert self.density is not None
        return QuantileThreshold(self.density)

    def _new_encoder(self) -> Encoder:
        return self.options.encoder(self._algorithm())

    def _set_encoders(self, encoders: list[Encoder]) -> None:
        """Every encoder replaced (a loaded state's), in the fragments' views too."""
        self.encoders[:] = encoders
        for f in self._fragments:
            f.set_encoders(encoders[f.span.first : f.span.last])

    def settings(self) -> dict[str, Any]:
        """What every rank must agree on, and a state records (:func:`settings_of`)."""
        return settings_of(self)

    # ------------------------------------------------------------------ counting

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._broken is None and _driving_scaler():
            self._broken = _SCALER_NOT_PASSED
        self._tick()

    @torch.no_grad()
    def _tick(self) -> None:
        if self._broken is not None:  # syncing stopped for good: say why at every step
            raise RuntimeError(self._broken)
        self.steps += 1
        flight = None if self._overlap is None else self._overlap.flight
        merge = self._schedule.merges(self.steps, flight)
        due = self._schedule.due(self.steps)
        if not (merge or due):
            return
        start = time.perf_counter()
        try:
            if merge:
                assert self._overlap is not None
                self._receive()
                self._overlap.merge()
            for span in due:
                self._sync(self._fragments[span.index])
        finally:
            self.sync_seconds += time.perf_counter() - start

    # ------------------------------------------------------------------ the round

    def _sync(self, frag: Fragment) -> None:
        """One sync of ``frag``; on any error nothing is stepped."""
        if isinstance(self._private, Member):
            return elastic_sync(self, frag, self._private)
        if self._overlap is not None:
            self._receive()  # the last round's exchange ends before this thread's collectives
        received = self._overlap is not None and self._overlap.received
        self.bytes_sent += self._protocol.begin(frag, self.syncs, self.decay, received)
        job, before = self._protocol.mean_job(frag, self.syncs, self._unsent, self.outer)
        if self._overlap is not None:
            self._overlap.launch(frag, job, before, self._unsync)
            self.syncs += 1
            return
        self.bytes_sent += undone_on_error(frag, before, job)
        self._step(frag)
        frag.take_global()
        self.dense_bytes += 4 * frag.numel
        self.syncs += 1
        logger.debug("LocalSteps sync %d: %d bytes sent in all", self.syncs, self.bytes_sent)

    def _unsync(self) -> None:  # a round in flight failed: its number is used again
        self.syncs -= 1

    def _step(self, frag: Fragment) -> None:
        """``frag``'s outer step; one that fails stops syncing for good."""
        try:
            what = f"LocalSteps sync round {self.syncs} (outer optimizer {self._outer_text})"
            frag.outer_step(self.outer, what)
        except OuterStepError as e:
            self._broken = str(e)
            raise

    def _receive(self) -> None:
        """``overlap``: wait for the round in flight and count its bytes. A failed round is
        undone and its error raised."""
        assert self._overlap is not None
        start = time.perf_counter()
        try:
            got = self._overlap.receive()
        finally:
            self.wait_seconds += time.perf_counter() - start
        if got is not None:
            self.bytes_sent += got[0]
            self.dense_bytes += 4 * got[1]

    @torch.no_grad()
    def flush(self) -> None:
        """Merge the round in flight now (``overlap``; nothing to do without): its outer
        step is taken and the model keeps this replica's moves since its send and its carry
        (a failed exchange raises, with every encoder put back)."""
        if self._overlap is not None:
            self._receive()
            self._overlap.flush()

    def average(self) -> None:
        """At the end of a run (a collective): every replica and the global copy take the mean
        of the replicas, where they may differ (:func:`_alike`), with a dense all-reduce;
        under ``elastic``, a sync with the quorum of the moment."""
        self.flush()
        if _alike(self) or self.left:
            return
        if isinstance(self._private, Member):
            elastic_sync(self, self._fragments[0], self._private)
        else:
            self.bytes_sent += self._protocol.average_(self.params, self.global_params)

    def metrics(self) -> dict[str, float]:
        """:func:`~gradshare.distributed.metrics.share_metrics` of the counters and of the
        last sync whose exchange completed."""
        shown = [e.last_stats for e in self.encoders]
        if self._overlap is not None:  # the last round whose exchange completed
            shown = self._overlap.round.shown
        stalled = self._unsent.stalled()
        return share_metrics(
            self.bytes_sent, self.dense_bytes, shown, encoded=not self.dense, stalled=stalled
        )

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        """This rank's global copy, residuals, threshold and outer states, counters and
        settings, in plain types (``torch.load(weights_only=True)`` reads it); a round in
        flight is waited for and saved (:mod:`.state`)."""
        return state_io.state_dict(self)

    def load_state_dict(self, state: Any, *, resize: bool = False) -> None:
        """Restore this rank's :meth:`state_dict` (any earlier format too), all checked
        before anything changes; ``resize=True``: ``state`` maps file names to every
        rank's state of another world size (:func:`.state.load_resized`)."""
        (load_resized if resize else state_io.load_state_dict)(self, state)

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Stop syncing: :meth:`flush`, then remove the step hook (also when that raises)."""
        try:
            self.flush()
        finally:
            self._unhook()
            if self._overlap is not None:
                self._overlap.close()
            if isinstance(self._private, Member):
                self._private.shutdown()

    def _unhook(self) -> None:
        _SYNCED.pop(self.inner, None)
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self._scaler is not None:
            self._scaler.__dict__.pop("update", None)
            self._scaler = None

    def __enter__(self) -> LocalSteps:
        return self

    def __exit__(self, error: object, *exc: object) -> None:
        if error is None:
            self.close()
        else:  # an error on its way (a peer may be gone): stop syncing, wait for nothing
            self._unhook()

    def __repr__(self) -> str:
        return _describe(self)


def _alike(ls: LocalSteps) -> bool:
    """Whether the replicas are alike now: the last step synced the whole model (one
    fragment, no overlap), or none was taken. :meth:`LocalSteps.average` costs 4 bytes per
    element sent; it is skipped then."""
    return not (ls.overlap or ls.fragments > 1 or ls.steps % ls.sync_every)


def _describe(ls: LocalSteps) -> str:
    mode = "dense" if ls.dense else ls.settings()["threshold"]
    return (
        f"LocalSteps(sync_every={ls.sync_every}, {mode}, decay={ls.decay}, "
        f"outer={ls._outer_text}{f', overlap={ls.overlap}' if ls.overlap else ''}"
        f"{f', fragments={ls.fragments}' if ls.fragments > 1 else ''})"
    )


def _hook(ls: LocalSteps, inner: torch.optim.Optimizer, scaler: Any) -> Any:
    """Count iterations: by the inner optimizer's steps (its hook's handle), or by
    ``scaler.update()`` (None)."""
    _SYNCED[inner] = None
    if scaler is None:
        return inner.register_step_post_hook(ls._after_step)
    update = scaler.update

    def counted_update(new_scale: Any = None) -> None:
        update(new_scale)
        ls._tick()

    scaler.update = counted_update
    return None


def _agree_and_broadcast(ls: LocalSteps, buffers: BufferSync) -> None:
    """At construction: every rank's settings agree; every replica takes rank 0's parameters
    and buffers."""
    agree(ls.settings(), group=ls._private.get(), timeout=ls.timeout, what="LocalSteps",
          device=ls.device)  # fmt: skip
    ls._protocol.broadcast_from_rank0(ls.params)
    buffers.sync()


def _build_rounds(ls: LocalSteps) -> tuple[list[Fragment], Buffers, Overlap | None]:
    """The fragments (their views of the flat buffers cut once), the buffers, and with
    ``overlap`` what runs rounds in the background."""
    whole = [not ls.dense and sends_whole(ls._algorithm(), p.numel()) for p in ls.params]
    fragments, flat = build_fragments(
        ls._schedule.spans,
        ls.names,
        ls.params,
        ls.global_params,
        ls.encoders,
        whole,
        home=ls.home,
        keep_delta=ls.dense or ls.overlap == ls.sync_every,
        overlap=bool(ls.overlap),
        send_in_pass=not ls.dense and 0 < ls.overlap < ls.sync_every,
        compact=ls.compact,
    )
    if not ls.overlap:
        return fragments, flat, None
    assert flat.base is not None
    return fragments, flat, Overlap(fragments, flat.base, ls.device, ls._step)


_SCALER_NOT_PASSED = (
    "LocalSteps counts inner steps, but a torch.amp.GradScaler steps this optimizer, and it "
    "skips the step on a rank whose gradients overflowed: that rank would sync one step late "
    "in every round (and the others wait for it). Pass `grad_scaler=scaler` to LocalSteps: it "
    "then counts iterations by `scaler.update()`, which every rank calls. Syncing stopped; "
    "close() this LocalSteps and build it again with the scaler."
)


def settings_of(ls: LocalSteps) -> dict[str, Any]:
    """:meth:`LocalSteps.settings`: one dict for the agreement between ranks and the state."""
    o = ls.options
    if ls.dense:
        threshold = "dense"
    else:
        threshold = (
            f"{ls._algorithm()!r} magnitude={o.magnitude} boundary={o.boundary} "
            f"post_processor={o.post_processor!r} reduction={o.reduce('mean')}"
        )
    return {
        "sync_every": ls.sync_every,
        "density": ls.density,
        "decay": ls.decay,
        "dense": ls.dense,
        "overlap": ls.overlap,
        "fragments": ls.fragments,
        "threshold": threshold,
        "outer_optimizer": ls._outer_text,
        "names": list(ls.names),
        "shapes": [list(p.shape) for p in ls.params],
        "dtypes": [str(p.dtype) for p in ls.params],
        "world_size": ls._protocol.world,
        "grad_scaler": ls._scaler is not None,
        "compact": ls.compact,
        "buffers": ls._protocol.buffers.layout(),
    }


def _optimizer_text(optimizer: torch.optim.Optimizer) -> str:
    """The outer optimizer's class and settings (its first group's, less the parameters)."""
    group = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    return f"{type(optimizer).__name__}({sorted(group.items())!r})"


def _driving_scaler() -> bool:
    """Whether an enabled ``torch.amp.GradScaler`` called the optimizer step that runs this
    hook (its ``step`` is on the stack a few frames up)."""
    from torch.amp import GradScaler

    frame: Any = sys._getframe(2)
    for _ in range(12):
        if frame is None:
            return False
        scaler = frame.f_locals.get("self")
        if isinstance(scaler, GradScaler):
            return scaler.is_enabled()  # a disabled one steps every time
        frame = frame.f_back
    return False


def _check_arguments(
    model: Any,
    inner: Any,
    grad_scaler: Any,
    local: LocalStepsOptions,
    threshold: Any,
    dense: bool,
    elastic: Any,
) -> None:
    """Refuse bad constructor arguments, one error each naming the argument and the fix."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        raise TypeError(
            "Expect a plain model, got one wrapped in DistributedDataParallel: LocalSteps "
            "keeps a full replica per rank and syncs it itself; pass `model.module` and drop "
            "DDP (its gradient all-reduce would defeat the local steps)."
        )
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"Expect `model` to be a torch.nn.Module, got {type(model).__name__}.")
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(
            f"Expect `inner_optimizer` to be a torch.optim.Optimizer, got {type(inner).__name__}."
        )
    if not any(True for _ in model.parameters()):
        raise ValueError("Expect a model with parameters: there is nothing to sync.")
    complex_ = [n for n, p in model.named_parameters() if p.is_complex()]
    if complex_:
        raise TypeError(
            f"Expect real parameters, got complex {complex_[0]!r} (of {len(complex_)}): its "
            "imaginary moves would not be synced. Keep it as a real parameter "
            "(torch.view_as_real) and view it as complex in forward."
        )
    held = {id(p) for g in inner.param_groups for p in g["params"]}
    if not any(id(p) in held for p in model.parameters()):
        raise ValueError(
            "Expect `inner_optimizer` to step the model's parameters, but it holds none of "
            "them: LocalSteps syncs the replicas after that optimizer's steps. Build it from "
            "`model.parameters()` (after any wrapping that replaces them)."
        )
    if inner in _SYNCED:
        raise ValueError(
            "Expect one LocalSteps per inner optimizer, but another one syncs this optimizer "
            "already (two would hook its steps twice and keep two global copies): close() "
            "the first, or leave its `with` block, before building another."
        )
    if grad_scaler is not None and not callable(getattr(grad_scaler, "update", None)):
        raise TypeError(
            f"Expect `grad_scaler` to be a torch.amp.GradScaler, got {type(grad_scaler).__name__}."
        )
    local.check(threshold, dense, sum(1 for _ in model.parameters()))
    if elastic is not None:
        if not isinstance(elastic, Elastic):
            raise TypeError(f"Expect `elastic` to be a gradshare.Elastic, got {elastic!r}.")
        if local.tau or local.fragments > 1:
            raise ValueError(
                f"Expect no `overlap` and one fragment with `elastic`, got overlap="
                f"{local.overlap!r}, fragments={local.fragments}: a rank that leaves sends its "
                "whole residual at one sync, and a round commits before the next."
            )
        return
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "LocalSteps needs a process group: call torch.distributed.init_process_group() "
            "first (torchrun sets the environment)."
        )
