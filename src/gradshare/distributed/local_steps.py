"""Local steps with sparse, error-feedback syncs: DiLoCo / SparseLoCo on gradshare's codec.

Each rank holds a full replica of the model and trains it alone with its own (inner) optimizer
for ``sync_every`` steps; then every rank sends how far its replica moved from the shared
*global copy*, threshold-encoded with error feedback (DL4J's messages), and every rank applies
the same averaged move to the global copy with an outer optimizer and starts again from it
(Douillard et al. 2023, DiLoCo; SparseLoCo: top-k with error feedback on that move). The user's
loop is unchanged: the sync runs in a step post-hook of the inner optimizer.
"""

from __future__ import annotations

import bisect
import copy
import itertools
import logging
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# Imported before any process group exists (see gradshare.distributed for why).
import torch.distributed.nn.functional

from gradshare import codec
from gradshare.codec import multipart
from gradshare.codec._flat import slices
from gradshare.distributed._overlap import InFlightRound
from gradshare.distributed.agreement import agree
from gradshare.distributed.buffers import BufferSync
from gradshare.distributed.checkpoint import (
    check_counter,
    check_encoder_state,
    check_mapping,
    check_optimizer_state,
)
from gradshare.distributed.exchange import (
    PrivateGroup,
    collective,
    exchange_messages,
    global_ranks,
    largest_message,
    rank_names,
)
from gradshare.distributed.metrics import Unsent, is_adaptive, share_metrics
from gradshare.encoding.encoder import Encoder
from gradshare.encoding.options import EncodingOptions, encoding_options
from gradshare.encoding.threshold import (
    BITMAP_DENSITY,
    QuantileThreshold,
    ThresholdAlgorithm,
    sends_whole,
)

__all__ = [
    "DEFAULT_DECAY",
    "DEFAULT_DENSITY",
    "DEFAULT_OUTER_LR",
    "DEFAULT_OUTER_LR_SGD",
    "LocalSteps",
    "default_outer_lr",
]

logger = logging.getLogger(__name__)

DEFAULT_DENSITY = 0.04
"""The fraction of each parameter's elements a sync sends by default (QuantileThreshold)."""
DEFAULT_DECAY = 0.95
"""β, the residual decay of every sync by default (SparseLoCo's error-feedback decay)."""
DEFAULT_OUTER_LR = 2.8
"""The learning rate of the default outer optimizer, plain SGD without momentum, when the inner
optimizer is adaptive (Adam and its kin, :func:`default_outer_lr`). Each sent entry carries
only ±threshold, so a sync moves the global copy less than Δ; bench/local_steps.py
(docs/benchmarks.md, "Local steps"): on the 0.43M GPT with AdamW, H=10, 4%, 2 ranks, 1,000
steps, lr 1.4 gave 1.067x dense DDP's validation loss and 2.8 gave 0.975x (3 seeds), 300
steps 1.033x, 5.6 diverged; at 4 ranks, 1,000 steps, 2.8 gave 1.002x (3 seeds; on seed 0 4.0
0.979x, 5.6 1.022x), so one constant serves 2 and 4 ranks."""
DEFAULT_OUTER_LR_SGD = 1.4
"""The default outer learning rate for any other inner optimizer (SGD, momentum SGD): on the
MNIST CNN with momentum SGD, H=10, 4%, 1.4 stayed 0.20 points from dense (3 seeds; 0.23 at 4
ranks) where 2.8 lost 1.7."""
FORMAT_VERSION = 4
"""The version of :meth:`LocalSteps.state_dict`'s layout (2 added ``pending`` and the
``overlap`` setting, 3 ``lead``, 4 ``base`` in its place, ``overlap`` in steps and the
``fragments`` setting, with the ``fragment`` of a pending round; states of
versions 1 to 3 still load: 1 as one saved without overlap, 2 as one whose round in flight
started from the global copy, 3 as one of ``overlap=True``)."""

OuterFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]

# The sync header: one int64 per field, all-gathered before every sync. (The settings are
# compared once, at construction, by gradshare.distributed.agreement.)
_FIELDS = ("round", "status", "bad_parameter")
_OK, _NONFINITE, _FAILED = 0, 1, 2


@dataclass(frozen=True)
class _Fragment:
    """A run of parameters synced together (Streaming DiLoCo's fragment)."""

    index: int
    first: int
    """Its parameters: ``params[first:last]``."""
    last: int
    start: int
    """Its elements in the flat buffers: ``[start, stop)``."""
    stop: int
    offset: int
    """Its syncs come at the steps ≡ ``offset`` (mod ``sync_every``); 0 for the first."""

    @property
    def numel(self) -> int:
        return self.stop - self.start


def _partition(sizes: list[int], parts: int, sync_every: int) -> list[_Fragment]:
    """``parts`` runs of consecutive parameters with about equal elements each, their syncs
    spread evenly over the ``sync_every`` steps."""
    cum = list(itertools.accumulate(sizes))
    cuts = [0]
    for k in range(1, parts):
        i = bisect.bisect_left(cum, k * cum[-1] / parts) + 1
        cuts.append(min(max(i, cuts[-1] + 1), len(sizes) - (parts - k)))
    cuts.append(len(sizes))
    starts = [0, *cum]
    return [
        _Fragment(k, cuts[k], cuts[k + 1], starts[cuts[k]], starts[cuts[k + 1]],
                  k * sync_every // parts)
        for k in range(parts)
    ]  # fmt: skip


def default_outer_lr(inner: torch.optim.Optimizer) -> float:
    """The default outer optimizer's learning rate for ``inner``: :data:`DEFAULT_OUTER_LR` for
    an adaptive optimizer (:func:`~gradshare.distributed.metrics.is_adaptive`: Adam and its
    kin, their subclasses, wrappers such as accelerate's looked through), else
    :data:`DEFAULT_OUTER_LR_SGD`."""
    return DEFAULT_OUTER_LR if is_adaptive(inner) else DEFAULT_OUTER_LR_SGD


def _default_outer(lr: float) -> OuterFactory:
    return lambda params: torch.optim.SGD(params, lr=lr)


class LocalSteps:
    """Sync replicas every ``sync_every`` inner steps with sparse, error-feedback messages.

    Each rank trains its own replica; every ``sync_every``-th ``inner_optimizer.step()``
    ends with a sync, on every rank:

    1. Δ = global - local, per parameter (the *outer gradient*: how far the replica moved);
       every rank tells the others (a small int64 header) its round, its settings and
       whether its Δ is finite; a difference, or a non-finite Δ anywhere, raises the same
       error on every rank before anything changes;
    2. residual = β·residual + Δ (β = ``decay``; β = 1 is DL4J's residual);
    3. the residual is threshold-encoded (one :class:`~gradshare.Encoder` per parameter,
       :class:`~gradshare.QuantileThreshold` of ``density`` by default; sparse indices, or a
       bitmap when too many cross): what is sent leaves the residual, the rest waits. Every
       parameter sends 2 entries a sync at least (DL4J's messages carry no fewer), so the
       biases and norms of narrow layers train too; a 1-element parameter (or, under another
       ``threshold`` algorithm, one too small for its messages:
       :func:`~gradshare.encoding.threshold.sends_whole`) sends all of its residual, a dense
       piece of float32 values;
    4. every rank's message (its parameters' pieces back to back) is all-gathered;
    5. every piece is validated whole, and the pieces are decoded in rank order into their
       sum, divided by the world size: the average outer gradient, alike on every rank;
    6. the outer optimizer steps the global copy with that average as its gradient (a
       step that turns it non-finite raises, naming the outer optimizer, and syncing stops);
    7. the global copy is copied into the model: the replicas' parameters are bit-identical
       after a sync; so are their buffers (BatchNorm's statistics: rank 0's, as DDP does,
       sent with step 1 only where they differ; ``broadcast_buffers``). Each rank's inner
       optimizer state stays its own.

    With ``dense=True`` (or ``density=1.0``) step 2-5 are an exact float32 all-reduce of Δ
    (DiLoCo); with ``outer_optimizer=lambda p: torch.optim.SGD(p, lr=1.0)`` a dense sync
    leaves every replica at the mean of the ranks' replicas.

    Fragments (``fragments=P``, Streaming DiLoCo): the parameters are cut into P runs of
    about equal size, and fragment f goes through steps 1-7 alone, at the steps ≡
    f·``sync_every``/P (mod ``sync_every``); the other parameters are left as they are (the
    outer optimizer steps only the fragment's, which alone have a gradient). Each exchange
    carries 1/P of the bytes; a fragment is bit-identical on every rank right after its own
    sync (or merge), the others keep their moves since theirs.

    Tuning: ``density`` sets the bytes (``bytes_sent`` vs ``dense_bytes``); ``decay`` < 1
    forgets stale residual mass; the outer learning rate (default :func:`default_outer_lr`:
    2.8 under an adaptive inner optimizer such as AdamW, 1.4 under SGD) scales each merge.

    Mixed precision: ``torch.amp.GradScaler`` skips ``inner.step()`` on a rank whose
    gradients overflowed, so counting inner steps would put that rank's syncs one step
    later than the others' (and the others would wait out the timeout). Pass
    ``grad_scaler=scaler``: iterations are then counted by ``scaler.update()``, which every
    rank calls every iteration, and a rank whose step was skipped still syncs when due.
    Without it, LocalSteps refuses (a RuntimeError at the first step) once it sees a
    GradScaler step the optimizer. The global copy of a float16 or bfloat16 model is kept
    in float32.

    Overlap (``overlap=τ``, an int in [1, ``sync_every``]; ``True`` is ``sync_every``): the
    exchange runs in a background thread while the ranks take their next τ inner steps,
    instead of stopping them. At sync k every rank exchanges the header (step 1,
    synchronously, as above), encodes Δ_k (steps 2-3), launches its exchange (step 4) and
    goes on training. After the τ-th step that follows, it waits for the exchange, takes the
    outer step with its mean (steps 5-6) and the model takes the global copy (step 7): the
    replicas are bit-identical after every merge. What each replica moved during those τ
    steps is not dropped: it stays this rank's own *carry*, and the next Δ is measured from
    the global copy plus the carry, so it goes out with the next sync. With τ =
    ``sync_every`` (``True``) the merge comes at the next sync, just after Δ_k+1 is taken, and
    the model takes the global copy plus that outer step again (a *lead*, the same on every
    rank, standing in for the round now in flight; it never enters the global copy). A
    smaller τ merges sooner: less staleness, and the link has τ steps of compute to carry
    the round. :meth:`flush` merges the round in flight at once, keeping this replica's
    moves since its send and its carry in the model (the replicas then differ until the
    next merge, as between syncs); :meth:`close` and leaving the ``with`` block flush;
    :meth:`state_dict` waits for the round and saves its mean. A failed background exchange
    raises, at the next merge, sync, :meth:`flush`, :meth:`close` or :meth:`state_dict`,
    the error the exchange raised (an :class:`~gradshare.ExchangeError` for a lost peer),
    with every encoder put back as it was before that round and the round's moves kept for
    the next sync. ``bytes_sent``, ``dense_bytes`` and :meth:`metrics` count a round when
    its exchange completes; ``syncs`` counts the rounds started.

    Args:
        model: this rank's replica (not wrapped in DistributedDataParallel). Rank 0's
            parameters are broadcast at construction, so the replicas start equal.
        inner_optimizer: the optimizer the training loop steps (its ``step`` is hooked).
        sync_every: inner steps between syncs (H), an int >= 1.
        density: the fraction of each parameter's elements a sync sends, in (0, 1/16), or 1.0
            for dense syncs.
        decay: β, the residual's decay before each sync, in [0, 1].
        outer_optimizer: a callable taking the global copy's tensors and returning the outer
            optimizer (default: ``SGD(params, lr=default_outer_lr(inner_optimizer))``, no
            momentum).
        offload: keep the global copy, residuals and outer state on the CPU.
        overlap: exchange each sync in the background during the next τ inner steps and
            merge it after them (see above): an int τ in [1, ``sync_every``], ``True`` for
            ``sync_every``; off (``False`` or 0) by default.
        fragments: sync the model in this many fragments, runs of consecutive parameters
            of about equal size, each in its turn (Streaming DiLoCo): fragment f syncs at
            the steps ≡ f·``sync_every``/fragments (mod ``sync_every``), alone, so each
            exchange carries 1/fragments of the bytes; with ``overlap``, τ is at most the
            steps between two fragments' syncs. 1 (the whole model at once) by default.
        grad_scaler: the run's ``torch.amp.GradScaler``, to count iterations by its
            ``update()`` (see above).
        broadcast_buffers: make the model's buffers rank 0's at every sync (True by
            default, as DDP does before every forward); False leaves each rank's own.
        compact: send each sparse piece in its compact form (:func:`gradshare.compact_message`:
            the gaps between indices in bytes, ~8-9 bits per entry instead of DL4J's 32),
            when that is shorter. Lossless: the replicas, residuals and losses are bit for
            bit those of DL4J's messages; only ``bytes_sent`` shrinks. Off by default (DL4J's
            format, which a DL4J decoder reads).
        group: the process group (default: the world).
        options: the encoding settings (:class:`~gradshare.EncodingOptions`), or give its
            fields as keywords: ``threshold`` (an algorithm to use instead of
            ``QuantileThreshold(density)``, cloned per parameter), ``post_processor``,
            ``boundary``, ``magnitude``, ``dense`` (exact float32 syncs: DiLoCo),
            ``reduction`` (``"mean"`` by default: the average outer gradient; ``"sum"``),
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
        sync_every: int,
        *,
        density: float = DEFAULT_DENSITY,
        decay: float = DEFAULT_DECAY,
        outer_optimizer: OuterFactory | None = None,
        offload: bool = False,
        overlap: bool | int = False,
        fragments: int = 1,
        grad_scaler: Any = None,
        compact: bool = False,
        broadcast_buffers: bool = True,
        group: Any = None,
        options: EncodingOptions | None = None,
        **encoding: Any,
    ) -> None:
        self.options = encoding_options(options, encoding, "LocalSteps")
        dense, threshold = self.options.dense, self.options.threshold
        _check_arguments(model, inner_optimizer, sync_every, density, decay, threshold, overlap,
                         fragments)  # fmt: skip
        self.compact = _check_bool(compact, "compact", "True sends sparse pieces in their "
                                   "compact form, False in DL4J's")  # fmt: skip
        _check_bool(broadcast_buffers, "broadcast_buffers", "True makes every rank's buffers "
                    "rank 0's at each sync, as DDP does")  # fmt: skip
        if grad_scaler is not None and not callable(getattr(grad_scaler, "update", None)):
            raise TypeError(
                f"Expect `grad_scaler` to be a torch.amp.GradScaler, got "
                f"{type(grad_scaler).__name__}."
            )
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "LocalSteps needs a process group: call torch.distributed.init_process_group() "
                "first (torchrun sets the environment)."
            )
        # settings
        self.sync_every = sync_every
        self.dense = bool(dense) or (threshold is None and density == 1.0)
        self.density = None if threshold is not None else 1.0 if self.dense else float(density)
        self.decay = float(decay)
        self.magnitude = self.options.magnitude
        self.offload = bool(offload)
        self.overlap = _overlap_steps(overlap, sync_every)
        """τ: the inner steps each round's exchange runs in the background (0: no overlap)."""
        self.timeout = timedelta(seconds=self.options.seconds())
        self.group = group
        self.model = model
        self.inner = inner_optimizer
        self.names = [name for name, _ in model.named_parameters()]
        self.params = [p for _, p in model.named_parameters()]
        self.numel = sum(p.numel() for p in self.params)
        self.fragments = fragments
        self._parts = _partition([p.numel() for p in self.params], fragments, sync_every)
        """The fragments, each synced in its turn (one, every parameter, by default)."""
        self.device = self.params[0].device
        """Where the collectives run (the model's device)."""
        self.home = torch.device("cpu") if self.offload else self.device
        """Where the global copy, residuals and outer state live."""
        self._threshold = threshold
        self._private = PrivateGroup(group, self.timeout)
        self._world = dist.get_world_size(group)
        self._rank = dist.get_rank(group)
        self._buffers = BufferSync(model if broadcast_buffers else torch.nn.Module(),
                                   self._private, self.device)  # fmt: skip
        """The model's buffers, made rank 0's at every sync (``broadcast_buffers``)."""
        self._unsent = Unsent("LocalSteps")
        self._broken: str | None = None
        """Why syncing stopped for good (an outer step that overflowed), or None."""
        # state
        self.steps = 0
        """Inner iterations counted (steps, or ``update()`` calls with a grad scaler)."""
        self.syncs = 0
        """Syncs completed (with ``overlap``: started, the last may be in flight): the round
        number of the next one."""
        # stats
        self.bytes_sent = 0
        """Bytes of the messages this rank sent (dense syncs: 4 per element)."""
        self.dense_bytes = 0
        """Bytes the same syncs take sent dense in float32."""
        self.sync_seconds = 0.0
        """Wall seconds the training loop spent in this object's syncs and merges since it
        was built (waits for exchanges in flight included): what local steps add to the
        steps, besides any CPU the background exchange takes from them. Not checkpointed."""
        self.wait_seconds = 0.0
        """Wall seconds spent waiting for an exchange in flight (``overlap``: at merges, and
        at :meth:`flush`, :meth:`state_dict` or :meth:`close`). More than a little at merges
        means the link does not carry a round in τ steps. Not checkpointed."""

        outer = outer_optimizer or _default_outer(default_outer_lr(inner_optimizer))
        probe_outer = outer([torch.zeros(1)])  # its settings, for the header
        self._outer_text = _optimizer_text(probe_outer)
        self._scaler_counts = grad_scaler is not None
        agree(
            self._agreed_settings(),
            group=self._private.get(),
            timeout=self.timeout,
            what="LocalSteps",
            device=self.device,
        )  # before anything: every rank alike
        self._broadcast_from_rank0()
        self._buffers.sync()
        self.global_params = [
            p.detach().to(self.home, _global_dtype(p.dtype), copy=True).requires_grad_(False)
            for p in self.params
        ]
        """The global copy: the parameters every replica starts each round from (float32
        for float16 and bfloat16 parameters, so that small outer steps are not rounded
        away)."""
        self.outer = outer(self.global_params)
        self.encoders: list[Encoder] = [] if self.dense else [
            self.options.encoder(self._algorithm()) for _ in self.params
        ]  # fmt: skip
        """Per parameter: its residual and threshold state (none for dense syncs)."""
        self._whole = [not self.dense and sends_whole(self._algorithm(), p.numel())
                       for p in self.params]  # fmt: skip
        """Per parameter: too small for threshold messages, so sent whole (a dense piece)."""
        f32, home = torch.float32, self.home
        self._delta = torch.zeros(self.numel if self.dense or self.overlap else 0, dtype=f32,
                                  device=home)  # fmt: skip
        """Δ of the fragment being synced, kept for dense syncs (their message) and for
        ``overlap`` (a failed round takes it again); encoded syncs add Δ into the residuals
        in the pass that computes it, and keep none."""
        self._mean = torch.zeros(self.numel, dtype=f32, device=home)
        largest = max(part.numel for part in self._parts)
        self._backup = torch.empty(0 if self.dense else largest, dtype=f32, device=home)
        """The residuals of the fragment being synced as they were before its Δ was added,
        while its round may still fail (one round is in flight at most)."""
        self._round = InFlightRound(self.device) if self.overlap else None
        """With ``overlap``: the round whose exchange runs in the background."""
        self._flight: int | None = None
        """With ``overlap``: the fragment whose round is in flight or waits for its merge."""
        self._base = torch.zeros_like(self._mean) if self.overlap else None
        """With ``overlap``, flat float32: for the fragment whose round is in flight (or whose
        mean waits for the merge), this replica's parameters at its send; elsewhere the next
        round's start less the global copy (the carry)."""
        self._scaler = grad_scaler
        self._handle: Any = None
        _SYNCED[inner_optimizer] = None
        if grad_scaler is None:
            self._handle = inner_optimizer.register_step_post_hook(self._after_step)
        else:
            update = grad_scaler.update

            def counted_update(new_scale: Any = None) -> None:
                update(new_scale)
                self._tick()

            grad_scaler.update = counted_update

    # ------------------------------------------------------------------ set-up

    def _algorithm(self) -> ThresholdAlgorithm:
        if self._threshold is not None:
            return self._threshold.clone()
        assert self.density is not None
        return QuantileThreshold(self.density)

    def _divisor(self) -> int:
        """What the summed outer gradients are divided by: the world size (``"mean"``)."""
        return self._world if self.options.reduce("mean") == "mean" else 1

    def _threshold_text(self) -> str:
        if self.dense:
            return "dense"
        o = self.options
        return (
            f"{self._algorithm()!r} magnitude={o.magnitude} boundary={o.boundary} "
            f"post_processor={o.post_processor!r} reduction={o.reduce('mean')}"
        )

    def _shapes(self) -> list[list[int]]:
        return [list(p.shape) for p in self.params]

    @torch.no_grad()
    def _broadcast_from_rank0(self) -> None:
        flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        collective(dist.broadcast, flat, src=src, group=self._private.get(),
                   timeout=self.timeout, what="parameter broadcast", rank=self._rank)  # fmt: skip
        for p, piece in zip(self.params, slices(flat, (p.numel() for p in self.params)),
                            strict=True):  # fmt: skip
            p.copy_(piece.view_as(p))

    # ------------------------------------------------------------------ counting

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._broken is None and _driving_scaler():
            self._broken = (
                "LocalSteps counts inner steps, but a torch.amp.GradScaler steps this "
                "optimizer, and it skips the step on a rank whose gradients overflowed: that "
                "rank would sync one step late in every round (and the others wait for it). "
                "Pass `grad_scaler=scaler` to LocalSteps: it then counts iterations by "
                "`scaler.update()`, which every rank calls. Syncing stopped; close() this "
                "LocalSteps and build it again with the scaler."
            )
        self._tick()

    def _tick(self) -> None:
        if self._broken is not None:  # syncing stopped for good: say why at every step
            raise RuntimeError(self._broken)
        self.steps += 1
        flight, h = self._flight, self.sync_every
        merge = (flight is not None and not self._lead_mode()
                 and (self.steps - self.overlap) % h == self._parts[flight].offset)  # fmt: skip
        due = [part for part in self._parts if self.steps % h == part.offset]
        if not (merge or due):
            return
        start = time.perf_counter()
        try:
            if merge:
                self._merge_due()
            for part in due:
                self._sync(part)
        finally:
            self.sync_seconds += time.perf_counter() - start

    def _lead_mode(self) -> bool:
        """τ = ``sync_every`` (one fragment): each merge comes at the next sync, with a lead."""
        return self.overlap == self.sync_every

    # ------------------------------------------------------------------ the sync

    def _agreed_settings(self) -> dict[str, Any]:
        """What every rank must agree on (compared at construction, readable when not)."""
        return {
            "sync_every": self.sync_every,
            "density": self.density,
            "decay": self.decay,
            "dense": self.dense,
            "overlap": self.overlap,
            "fragments": self.fragments,
            "threshold": self._threshold_text(),
            "outer_optimizer": self._outer_text,
            "world_size": self._world,
            "num_params": len(self.params),
            "shapes": [(n, s, str(p.dtype)) for n, s, p in
                       zip(self.names, self._shapes(), self.params, strict=True)],
            "grad_scaler": self._scaler_counts,
            "compact": self.compact,
            "buffers": self._buffers.layout(),
        }  # fmt: skip

    def _header_exchange(self, what: str, status: int = _OK, bad: int = -1) -> list[list[int]]:
        """All-gather every rank's ``[round, status, bad_parameter]`` and its buffers'
        digests; raise the same error on every rank when the rounds differ. Returns the table
        (one row per rank)."""
        row = [self.syncs, status, bad, *self._buffers.digests()]
        header = torch.tensor(row, dtype=torch.int64, device=self.device)
        headers = [torch.empty_like(header) for _ in range(self._world)]
        collective(dist.all_gather, headers, header, group=self._private.get(),
                   timeout=self.timeout, what=f"sync header ({what})", rank=self._rank)  # fmt: skip
        table = torch.stack(headers).cpu().tolist()
        rounds = {row[0] for row in table}
        if len(rounds) > 1:
            raise ValueError(
                f"LocalSteps ({what}): the ranks are at different sync rounds, "
                f"{_values(table, 'round', global_ranks(self.group))}: every rank must resume "
                "from the checkpoint of the same step."
            )
        return table

    @torch.no_grad()
    def _sync(self, part: _Fragment) -> None:
        """One sync of fragment ``part`` (steps 1-7 of the class docstring); on any error
        nothing is stepped."""
        if self._round is not None:
            self._receive()  # the last round's exchange ends before this thread's collectives
        status, bad, failure = _OK, -1, None
        try:
            bad = self._compute_delta(part)
            status = _OK if bad < 0 else _NONFINITE
        except Exception as e:
            status, failure = _FAILED, e
        try:
            table = self._header_exchange("sync", status, bad)
            if failure is not None:
                raise failure
            self._check_status(table)
            sent = self._buffers.take([row[len(_FIELDS) :] for row in table])  # where differ
            self.bytes_sent += sent if self._rank == 0 else 0  # rank 0 sent them
        except BaseException:
            if failure is None:  # Δ went into the residuals: they go back
                self._restore_residuals(part)
            raise
        if self._round is not None:
            self._overlapped_sync(part)
            return
        group = self._private.get()
        if self.dense:
            sent = self._dense_mean(group, part)
        else:
            mine, failure, before = self._encode(part)
            sent = self._undone_on_error(
                before, part, lambda: self._encoded_mean(mine, failure, group, self.syncs, part)
            )
        self.bytes_sent += sent
        self._outer_step(part)
        self._take_global(part)
        self.dense_bytes += 4 * part.numel
        self.syncs += 1

    def _overlapped_sync(self, part: _Fragment) -> None:
        """``overlap``, after the header: encode this round, merge the last one if its mean
        waits (τ = ``sync_every``), note where this round was sent from and launch its
        exchange in the background."""
        assert self._round is not None and self._base is not None
        group, number = self._private.get(), self.syncs
        before: list[dict[str, Any]] = []
        if self.dense:
            job: Callable[[], int] = lambda: self._dense_mean(group, part)
        else:
            mine, failure, before = self._encode(part)
            if failure is not None:  # tell the others now (nothing is in flight), and stop
                self._undone_on_error(
                    before, part, lambda: self._encoded_mean(None, failure, group, number, part)
                )
            job = lambda: self._encoded_mean(mine, None, group, number, part)
        if self._round.take():  # τ = sync_every: the last round, merged with a lead
            self._merge_with_lead()
        for p, b in zip(self._params(part), self._pieces(self._base, part), strict=True):
            b.copy_(p.detach().reshape(-1))  # where this round is sent from

        def undo() -> None:  # the exchange failed: nothing of this round stays
            self._put_back(before, part)
            self._unsend(part)
            self._flight = None
            self.syncs -= 1

        encoders = self._encoders(part)
        self._round.launch(job, undo, [e.last_stats for e in encoders])
        self._flight = part.index
        self.syncs += 1

    def _unsend(self, part: _Fragment) -> None:
        """A round's exchange failed: its Δ (still in ``_delta``) is taken again at the next
        sync, as without overlap. ``_base`` goes back from the send point to the start the
        round was measured from (less the global copy)."""
        assert self._base is not None
        for g, b, d in zip(self._globals(part), self._pieces(self._base, part),
                           self._pieces(None, part), strict=True):  # fmt: skip
            b.add_(d).sub_(g.reshape(-1))

    @torch.no_grad()
    def _merge_due(self) -> None:
        """``overlap`` τ < ``sync_every``, τ steps after a fragment's sync: wait for its round,
        step the fragment's global copy with its mean, and the model takes it; what the
        replica moved since the send becomes its carry (``_base``), which the fragment's next
        Δ includes."""
        assert self._round is not None and self._base is not None
        self._receive()
        if not self._round.take():
            return  # none in flight: before the first sync, or after a flush
        assert self._flight is not None  # a round received is a fragment's
        part = self._parts[self._flight]
        for p, b in zip(self._params(part), self._pieces(self._base, part), strict=True):
            b.sub_(p.detach().reshape(-1).to(self.home))  # the carry: sent-from - now
        self._outer_step(part)
        self._take_global(part)
        self._flight = None

    def _merge_with_lead(self) -> None:
        """``overlap`` τ = ``sync_every``, at a sync whose Δ is taken: step the global copy
        with the last round's mean and start the next round from it, one outer step ahead
        (the lead: that step again, standing in for the round now launched)."""
        assert self._base is not None
        whole = self._parts[0]  # the lead needs one fragment: the whole model
        for g, b in zip(self.global_params, self._pieces(self._base), strict=True):
            b.copy_(g.reshape(-1))
        self._outer_step(whole)
        for g, b, p in zip(self.global_params, self._pieces(self._base), self.params,
                           strict=True):  # fmt: skip
            torch.sub(g.reshape(-1), b, out=b)  # the lead: this merge's outer step
            p.detach().copy_(torch.add(g, b.view_as(g)).to(g.dtype))
        self._flight = None

    def _receive(self) -> None:
        """``overlap``: wait for the round in flight and count its bytes; its mean waits in
        ``_mean`` for the merge. A failed round is undone and its error raised."""
        assert self._round is not None
        flight = self._flight
        start = time.perf_counter()
        try:
            sent = self._round.wait()
        finally:
            self.wait_seconds += time.perf_counter() - start
        if sent is not None:
            self.bytes_sent += sent
            self.dense_bytes += 4 * (self.numel if flight is None else self._parts[flight].numel)

    def _compute_delta(self, part: _Fragment) -> int:
        """Δ = start - local for ``part``'s parameters, in float32; the index of the first
        parameter whose Δ is not finite (-1 when all are). Encoded syncs add it into each
        residual as it decays (residual = β·residual + Δ, the old residual kept in
        ``_backup``), in the one pass that computes it; dense syncs and ``overlap`` keep it in
        ``_delta``. If this raises, every residual is as it was. The start is the global
        copy; with overlap, plus ``_base`` (the carry), or ``_base`` itself when the last
        round's mean waits for its merge (τ = ``sync_every``: where that round was sent from,
        the lead included)."""
        bad, done = -1, 0
        n = part.last - part.first
        sent_from = self._round is not None and self._round.received
        none: list[Any] = [None] * n
        base = none if self._base is None else self._pieces(self._base, part)
        deltas = self._pieces(None, part) if self._delta.numel() else none
        encoders = none if self.dense else self._encoders(part)
        keeps = none if self.dense else self._backups(part)
        try:
            for i, g, p, d, b, enc, keep in zip(range(part.first, part.last),
                                                self._globals(part), self._params(part),
                                                deltas, base, encoders, keeps,
                                                strict=True):  # fmt: skip
                local = p.detach().to(self.home, torch.float32).reshape(-1)
                start = g.reshape(-1).to(torch.float32)
                if sent_from:  # the start is where that round was sent from
                    start, b = b, None
                if enc is None:
                    nonfinite = codec.subtract_(start, local, d, plus=b)
                else:
                    if enc.residual is None:
                        enc.residual = torch.zeros_like(local)
                    nonfinite = codec.decay_add_(enc.residual, self.decay, keep, start, local,
                                                 plus=b, out=d)  # fmt: skip
                    done += 1
                if bad < 0 and nonfinite:
                    bad = i
        except BaseException:
            self._restore_residuals(part, done)
            raise
        return bad

    def _restore_residuals(self, part: _Fragment, count: int | None = None) -> None:
        """The residuals of ``part``'s first ``count`` parameters (all) back from
        ``_backup``, as they were before :meth:`_compute_delta`."""
        if self.dense:
            return
        for enc, keep in zip(self._encoders(part)[:count], self._backups(part), strict=False):
            assert enc.residual is not None
            enc.residual.copy_(keep)

    def _backups(self, part: _Fragment) -> Iterator[torch.Tensor]:
        """``_backup`` cut into ``part``'s parameters' pieces (it holds one fragment)."""
        return slices(self._backup, (p.numel() for p in self._params(part)))

    def _pieces(
        self, flat: torch.Tensor | None = None, part: _Fragment | None = None
    ) -> Iterator[torch.Tensor]:
        """``flat`` (default: ``_delta``) cut into the parameters' pieces (of ``part`` only)."""
        flat = self._delta if flat is None else flat
        if part is None:
            return slices(flat, (p.numel() for p in self.params))
        return slices(flat[part.start : part.stop], (p.numel() for p in self._params(part)))

    def _params(self, part: _Fragment) -> list[torch.nn.Parameter]:
        return self.params[part.first : part.last]

    def _globals(self, part: _Fragment) -> list[torch.Tensor]:
        return self.global_params[part.first : part.last]

    def _encoders(self, part: _Fragment) -> list[Encoder]:
        return self.encoders[part.first : part.last]

    def _check_status(self, table: list[list[int]]) -> None:
        ranks = global_ranks(self.group)
        failed = [ranks[r] for r, row in enumerate(table) if row[1] == _FAILED]
        if failed:
            raise RuntimeError(
                f"LocalSteps sync round {self.syncs}: rank(s) {failed} failed to compute their "
                "outer gradient (see their own error); every rank stops here, nothing changed."
            )
        bad = {ranks[r]: row[2] for r, row in enumerate(table) if row[1] == _NONFINITE}
        if bad:
            where = ", ".join(f"rank {r} in parameter {self.names[i]!r}" for r, i in bad.items())
            raise ValueError(
                f"LocalSteps sync round {self.syncs}: the local parameters moved to non-finite "
                f"values on {where}: no outer step was taken on any rank, the global copy and "
                "the residuals are unchanged. Check the loss or lower the inner learning rate, "
                "then resume from a checkpoint."
            )

    def _dense_mean(self, group: Any, part: _Fragment) -> int:
        """Dense DiLoCo: the exact float32 mean of every rank's Δ of ``part`` into ``_mean``
        (``_delta`` stays as it is, for a failed round's undo); the bytes this rank sent."""
        mean = self._mean[part.start : part.stop]
        buf = mean.to(self.device)
        buf.copy_(self._delta[part.start : part.stop])
        collective(dist.all_reduce, buf, group=group, timeout=self.timeout,
                   what="dense all-reduce", rank=self._rank)  # fmt: skip
        if buf is not mean:
            mean.copy_(buf)
        mean.div_(self._divisor())
        return 4 * part.numel

    def _encode(
        self, part: _Fragment
    ) -> tuple[torch.Tensor | None, Exception | None, list[dict[str, Any]]]:
        """Step 3 for ``part``: encode each residual (step 2, β·residual + Δ, was
        :meth:`_compute_delta`'s) into this rank's message (its parameters' pieces back to
        back). Returns the message, the error if encoding failed, and every encoder's state
        from before this sync (a sync that fails puts it back)."""
        sizes = [p.numel() for p in self._params(part)]
        encoders = self._encoders(part)
        sent: list[tuple[torch.Tensor | None, float]] = []
        mine, failure = None, None
        # what each encoder held before this sync: one that fails puts it back whole (the
        # decay, Δ, what was encoded and the threshold state), since the replicas keep their
        # moves for the next; the residuals are in `_backup` (from _compute_delta's pass that
        # decayed them and added Δ), the rest goes to `before`
        before = [enc.state_dict(residual=False) for enc in encoders]
        try:
            for enc, state, keep in zip(encoders, before, self._backups(part), strict=True):
                state["residual"] = keep
                message: torch.Tensor | None
                if self._whole[part.first + len(sent)]:  # too small: a dense piece
                    message = enc.encode_whole(None, self.syncs)
                else:
                    message = enc.encode(None, self.syncs)
                if self.compact and message is not None:
                    message = codec.compact_message(message)
                assert enc.last_stats is not None
                self._unsent.count(self.names[part.first + len(sent)], enc.last_stats)
                sent.append((message, enc.last_stats.threshold))
            mine = multipart.join_messages(
                [m for m, _ in sent], sizes, [t for _, t in sent], self.home
            )
        except Exception as e:
            failure = e
        return mine, failure, before

    def _encoded_mean(
        self, mine: torch.Tensor | None, failure: Exception | None, group: Any, number: int,
        part: _Fragment,
    ) -> int:  # fmt: skip
        """Steps 4-5 of round ``number`` (fragment ``part``): exchange every rank's message,
        validate each whole and decode their mean into ``_mean``; the bytes this rank sent.
        With ``failure`` (this rank could not encode) the others raise naming it, and this
        rank raises it."""
        params = self._params(part)
        sizes = [p.numel() for p in params]
        messages = exchange_messages(
            None if mine is None else mine.to(self.device), part.numel,
            group=group, timeout=self.timeout, device=self.device,
            failure=failure, max_words=sum(largest_message(p.numel()) for p in params),
            round=number,
        )  # fmt: skip
        names = rank_names(self._world, group)
        pieces = [
            multipart.split_message(None if m is None else m.to(self.home), sizes, name,
                                    self.names[part.first : part.last])
            for m, name in zip(messages, names, strict=True)
        ]  # fmt: skip
        for i, target in enumerate(self._pieces(self._mean, part)):
            codec.decode_sum_([p[i] for p in pieces], target, divisor=self._divisor(),
                              names=names, checked=True)  # fmt: skip
        return 0 if mine is None else 4 * mine.numel()

    def _undone_on_error(
        self, before: list[dict[str, Any]], part: _Fragment, exchange: Callable[[], int]
    ) -> int:
        """``exchange()``; if it raises, nothing of this sync stays: every encoder as it was."""
        try:
            return exchange()
        except BaseException:
            self._put_back(before, part)
            raise

    def _put_back(self, before: list[dict[str, Any]], part: _Fragment) -> None:
        for enc, state in zip(self._encoders(part), before, strict=True):
            enc.load_state_dict(state)

    def _outer_step(self, part: _Fragment) -> None:
        """Step 6: the outer optimizer steps ``part``'s global copy with the mean in
        ``_mean`` (the other parameters have no gradient: it leaves them as they are)."""
        for g, m in zip(self._globals(part), self._pieces(self._mean, part), strict=True):
            g.grad = m.view_as(g).to(g.dtype)
        failure = None
        try:
            self.outer.step()
        except Exception as e:  # e.g. an lr that does not fit the global copy's dtype
            failure = f"raised {type(e).__name__}: {e}"
        for g in self._globals(part):
            g.grad = None
        if failure is None:
            bad = [i for i, g in enumerate(self._globals(part), part.first)
                   if codec.find_nonfinite(g.reshape(-1))[0]]  # fmt: skip
            if bad:
                failure = f"turned the global copy of parameter {self.names[bad[0]]!r} non-finite"
        if failure is not None:
            self._broken = (
                f"LocalSteps sync round {self.syncs}: the outer step {failure} (outer optimizer "
                f"{self._outer_text}), from a finite mean outer gradient: its learning rate is "
                "too large for it. The model kept its replica and syncing stopped; resume from "
                "a checkpoint with a lower outer learning rate."
            )
            raise ValueError(self._broken)

    def _take_global(self, part: _Fragment) -> None:
        """Step 7: ``part``'s parameters take the global copy."""
        for g, p in zip(self._globals(part), self._params(part), strict=True):
            p.detach().copy_(g)

    @torch.no_grad()
    def flush(self) -> None:
        """Merge the round in flight now (``overlap``; nothing to do without): wait for its
        exchange and step the global copy with its mean; the model takes the copy plus what
        this replica moved since that round's send, and its carry, if any, is given back to
        the model too. The next Δ is then measured from the global copy, as after the first
        sync. Right after a merge or a sync with nothing since, the replicas are
        bit-identical; between them each keeps its own moves, as between syncs. If the
        exchange failed, its error is raised and nothing is merged (every encoder is put back
        as it was before that round).
        """
        if self._round is None:
            return
        assert self._base is not None
        self._receive()
        flight, self._flight = self._flight, None
        if self._round.take():
            assert flight is not None  # a round received is a fragment's
            part = self._parts[flight]
            pieces = list(self._pieces(self._base, part))
            for p, b in zip(self._params(part), pieces, strict=True):
                torch.sub(p.detach().reshape(-1).to(self.home), b, out=b)  # moved since
            self._outer_step(part)
            for p, g, b in zip(self._params(part), self._globals(part), pieces, strict=True):
                p.detach().copy_(torch.add(g, b.view_as(g)).to(p.device, p.dtype))
                b.zero_()
        for p, b in zip(self.params, self._pieces(self._base), strict=True):
            p.detach().sub_(b.view_as(p).to(p.device, p.dtype))  # the carry (or lead) back
        self._base.zero_()

    def metrics(self) -> dict[str, float]:
        """``bytes_sent``, ``dense_bytes``, ``compression``, ``density`` and ``threshold``
        (the mean of the parameters' thresholds) of the last sync whose exchange completed,
        and ``stalled``, the parameters that have sent nothing for many syncs while holding a
        residual (:func:`~gradshare.distributed.metrics.share_metrics`)."""
        shown = self._round
        stats = shown.shown if shown is not None else [e.last_stats for e in self.encoders]
        return share_metrics(self.bytes_sent, self.dense_bytes, stats, encoded=not self.dense,
                             stalled=self._unsent.stalled())  # fmt: skip

    # ------------------------------------------------------------------ checkpointing

    def _settings(self) -> dict[str, Any]:
        return {
            "sync_every": self.sync_every,
            "density": self.density,
            "decay": self.decay,
            "dense": self.dense,
            "overlap": self.overlap,
            "fragments": self.fragments,
            "threshold": self._threshold_text(),
            "world_size": self._world,
            "rank": self._rank,
            "names": list(self.names),
            "shapes": self._shapes(),
            "outer_optimizer": self._outer_text,
        }

    def state_dict(self) -> dict[str, Any]:
        """This rank's global copy, residuals and threshold states, outer optimizer state,
        counters and settings, in plain types (``torch.load(weights_only=True)`` reads it).

        With ``overlap``, a round in flight is waited for first (its error raised, as at a
        sync) and ``pending`` holds its mean, merged when due in the resumed run; it is None
        when no round waits (and always without overlap), and ``fragment`` which fragment it
        is of. ``base`` (None without overlap) is this replica's parameters at that round's
        send (for its fragment; elsewhere, and when no round waits, the next round's start
        less the global copy: the carry)."""
        pending = None
        if self._round is not None:
            self._receive()
            if self._round.received:
                pending = self._mean.clone()
        fragment = self._flight if pending is not None else None
        return {
            "format": FORMAT_VERSION,
            "settings": self._settings(),
            "steps": self.steps,
            "syncs": self.syncs,
            "bytes_sent": self.bytes_sent,
            "dense_bytes": self.dense_bytes,
            "global": [g.detach().clone() for g in self.global_params],
            "encoders": [e.state_dict() for e in self.encoders],
            "outer": self.outer.state_dict(),
            "pending": pending,
            "fragment": fragment,
            "base": None if self._base is None else self._base.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's :meth:`state_dict`; check everything first, change nothing on
        any mismatch (another world size, rank, ``sync_every``, mode or model) or junk (a
        ValueError naming the field)."""
        state = check_mapping(state, "a LocalSteps state")
        legacy = state.get("format") == 1  # from before overlap: saved without, none pending
        if legacy:
            state = {**state, "format": 2, "pending": None}
        if state.get("format") == 2:  # from before the lead: its rounds started at the copy
            state = {**state, "format": 3, "lead": None}
        old_overlap = state.get("format") == 3  # overlap a bool, and the lead
        if old_overlap:
            state = _from_format_3(state)
        state = {"fragment": 0 if state.get("pending") is not None else None, **state}
        missing = {"format", "settings", "steps", "syncs", "bytes_sent", "dense_bytes",
                   "global", "encoders", "outer", "pending", "base"} - set(state)  # fmt: skip
        if missing:
            raise ValueError(f"LocalSteps state is missing {sorted(missing)}: is it one?")
        if state["format"] != FORMAT_VERSION:
            raise ValueError(
                f"LocalSteps state has format {state['format']!r}, this version reads 1 to "
                f"{FORMAT_VERSION}: resume with the gradshare version that saved it."
            )
        here, saved = self._settings(), check_mapping(state["settings"], "`settings`")
        saved = {"fragments": 1, **saved}  # before fragments: one
        # before the outer optimizer was recorded: not known; its state is checked below
        saved = {"outer_optimizer": here["outer_optimizer"], **saved}
        if legacy:
            saved = {"overlap": False, **saved}
        if old_overlap:  # (legacy too) a bool then: True was a merge at the next sync
            saved = {**saved, "overlap": self.sync_every if saved.get("overlap") is True else 0}
        counters = {k: check_counter(state, k, "LocalSteps state")
                    for k in ("steps", "syncs", "bytes_sent", "dense_bytes")}  # fmt: skip
        self._check_counters(counters["steps"], counters["syncs"])
        differ = [k for k in here if saved.get(k) != here[k]]
        if differ:
            raise ValueError(
                "LocalSteps state was saved with other settings: "
                + "; ".join(f"`{k}` {saved.get(k)!r} saved, {here[k]!r} here" for k in differ)
                + ": each rank loads the state its own rank saved, with the same arguments, "
                "model and world size."
            )
        if not isinstance(state["encoders"], list) or not isinstance(state["global"], list):
            raise ValueError("LocalSteps state's `encoders` and `global` must be lists: the "
                             "checkpoint is corrupted.")  # fmt: skip
        glob = state["global"]
        if len(glob) != len(self.params) or any(
            not isinstance(t, torch.Tensor) or t.shape != g.shape
            or t.dtype not in (g.dtype, p.dtype) or not bool(t.isfinite().all())
            for t, g, p in zip(glob, self.global_params, self.params, strict=False)
        ):  # fmt: skip
            raise ValueError(
                "LocalSteps state's global copy does not match the model's parameters (count, "
                "shape, dtype: the global copy's, or the parameter's in states saved before "
                "float16 and bfloat16 models kept a float32 copy) or is not finite: the "
                "checkpoint is of another model or corrupted."
            )
        if len(state["encoders"]) != len(self.encoders):
            raise ValueError(
                f"LocalSteps state holds {len(state['encoders'])} encoder states, this one has "
                f"{len(self.encoders)}: the checkpoint is of another model or mode."
            )
        probes = []
        for saved_enc, p in zip(state["encoders"], self.params[: len(self.encoders)], strict=True):
            check_encoder_state(saved_enc, p.numel(), "LocalSteps state")
            probe = self.options.encoder(self._algorithm())
            probe.load_state_dict(saved_enc)  # refuses a bad residual or another algorithm
            if probe.residual is not None and probe.residual.numel() != p.numel():
                raise ValueError(
                    f"LocalSteps state's residual has {probe.residual.numel()} elements, the "
                    f"parameter {p.numel()}: the checkpoint is of another model."
                )
            if probe.residual is not None:
                probe.residual = probe.residual.to(self.home)
            probes.append(probe)
        pending, base, fragment = state["pending"], state["base"], state["fragment"]
        if pending is not None and (
            isinstance(fragment, bool) or not isinstance(fragment, int)
            or not 0 <= fragment < len(self._parts)
        ):  # fmt: skip
            raise ValueError(
                f"LocalSteps state's `fragment` must be the index of the fragment whose round "
                f"waits (0 to {len(self._parts) - 1}), got {fragment!r}: the checkpoint is "
                "corrupted."
            )
        self._check_vector(pending, "`pending` (the mean of a round waiting for its merge)")
        self._check_vector(base, "`base` (where the round in flight was sent from, or the carry)")
        if old_overlap and pending is not None:  # its round was sent from the start then
            start = torch.cat([t.reshape(-1).to(self._mean) for t in glob])
            base = start if base is None else base.to(start) + start
        if pending is not None and base is None:
            raise ValueError(
                "LocalSteps state has a round waiting for its merge (`pending`) but not where "
                "it was sent from (`base` is None): the state mixes two runs or is corrupted."
            )
        check_optimizer_state(self.outer, state["outer"], "LocalSteps state's `outer`")
        copy.deepcopy(self.outer).load_state_dict(state["outer"])  # refuses another's state
        # everything checked: change
        if self._round is not None:
            self._round.drop()  # what was in flight is replaced by the state
            self._round.received = pending is not None
            self._flight = fragment if pending is not None else None
            if pending is not None:
                self._mean.copy_(pending)
        if self._base is not None:
            self._base.zero_()
            if base is not None:
                self._base.copy_(base)
        self.outer.load_state_dict(state["outer"])
        for g, t in zip(self.global_params, glob, strict=True):
            g.copy_(t)
        self.encoders = probes
        self.steps = counters["steps"]
        self.syncs = counters["syncs"]
        self.bytes_sent = counters["bytes_sent"]
        self.dense_bytes = counters["dense_bytes"]

    def _check_counters(self, steps: int, syncs: int) -> None:
        """Refuse counters that no run reaches: more syncs than ``steps`` inner steps hold
        (fewer is a run whose failed syncs were caught), or ``steps`` past 2**53."""
        h = self.sync_every
        due = sum(0 if steps < f.offset else (steps - f.offset) // h + (f.offset > 0)
                  for f in self._parts)  # fmt: skip
        if steps >= 2**53 or syncs > due:
            raise ValueError(
                f"LocalSteps state's counters disagree: `steps` {steps} and `syncs` {syncs}, "
                f"where {steps} inner steps hold at most {min(due, 2**53)} syncs at "
                f"sync_every={h}: the checkpoint is corrupted."
            )

    def _check_vector(self, value: Any, what: str) -> None:
        """A saved overlap vector: None, or (with overlap) a finite float32 vector."""
        if value is None or (
            self._round is not None
            and isinstance(value, torch.Tensor)
            and value.dtype == torch.float32
            and value.shape == self._mean.shape
            and bool(value.isfinite().all())
        ):
            return
        want = "None" if self._round is None else (
            f"None or a finite float32 vector of {self.numel} elements"
        )  # fmt: skip
        got = (f"{value.dtype} of shape {tuple(value.shape)}"
               if isinstance(value, torch.Tensor) else type(value).__name__)  # fmt: skip
        raise ValueError(
            f"LocalSteps state's {what} must be {want}, got {got}: the checkpoint is of "
            "another model or corrupted."
        )

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Stop syncing: merge the round in flight (:meth:`flush`, with ``overlap``), then
        remove the step hook (or the grad scaler's counting), also when the merge raises."""
        try:
            self.flush()
        finally:
            self._unhook()
            if self._round is not None:
                self._round.close()

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
        mode = "dense" if self.dense else self._threshold_text()
        return (
            f"LocalSteps(sync_every={self.sync_every}, {mode}, decay={self.decay}, "
            f"outer={self._outer_text}{f', overlap={self.overlap}' if self.overlap else ''}"
            f"{f', fragments={self.fragments}' if self.fragments > 1 else ''})"
        )


def _check_bool(value: Any, name: str, meaning: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"Expect `{name}` True or False, got {value!r}: {meaning}.")
    return value


def _global_dtype(dtype: torch.dtype) -> torch.dtype:
    """The global copy's dtype for parameters of ``dtype``: at least float32."""
    return torch.promote_types(dtype, torch.float32)


_SYNCED: weakref.WeakKeyDictionary[torch.optim.Optimizer, None] = weakref.WeakKeyDictionary()
"""The inner optimizers a LocalSteps hooks now (until its :meth:`~LocalSteps.close`)."""


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


def _overlap_steps(overlap: bool | int, sync_every: int) -> int:
    """τ for the ``overlap`` argument: ``True`` is ``sync_every``, ``False`` 0."""
    return sync_every if overlap is True else int(overlap)


def _from_format_3(state: dict[str, Any]) -> dict[str, Any]:
    """A state of format 3 (``lead`` where 4 has ``base``) in format 4's layout, its ``base``
    still relative to the global copy (the loader adds the copy when a round waits)."""
    out = {k: v for k, v in state.items() if k != "lead"}
    return {**out, "format": FORMAT_VERSION, "base": state["lead"]}


def _values(table: list[list[int]], field: str, ranks: list[int]) -> str:
    """``field`` on each (global) rank, as ``"`round` 1 on rank 0, 5 on rank 1"``."""
    j = _FIELDS.index(field)
    values = ", ".join(f"{row[j]} on rank {ranks[r]}" for r, row in enumerate(table))
    return f"`{field}` {values}"


def _optimizer_text(optimizer: torch.optim.Optimizer) -> str:
    """The outer optimizer's class and settings (its first group's, less the parameters)."""
    group = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    return f"{type(optimizer).__name__}({sorted(group.items())!r})"


def _check_arguments(
    model: Any,
    inner: Any,
    sync_every: Any,
    density: Any,
    decay: Any,
    threshold: Any,
    overlap: Any,
    fragments: Any = 1,
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
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(
            f"Expect `sync_every` to be an int >= 1 (inner steps between syncs), got "
            f"{sync_every!r}: pass e.g. sync_every=10."
        )
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density <= 1:
        raise ValueError(
            f"Expect `density` in (0, 1], got {density!r}: it is the fraction of elements a "
            "sync sends (1.0: dense)."
        )
    if threshold is None and BITMAP_DENSITY <= density < 1:
        raise ValueError(
            f"Expect `density` under 1/16 or exactly 1.0, got {density!r}: at 1/16 or more a "
            "bitmap message is smaller than the sparse one; pass density=1.0 (dense syncs) or a "
            "`threshold` algorithm."
        )
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 <= decay <= 1:
        raise ValueError(
            f"Expect `decay` in [0, 1], got {decay!r}: it is β in residual = β·residual + Δ "
            "(1: keep all of it, DL4J's residual)."
        )
    if threshold is not None and not isinstance(threshold, ThresholdAlgorithm):
        raise TypeError(
            f"Expect `threshold` to be a ThresholdAlgorithm or None, got "
            f"{type(threshold).__name__}: wrap a number as FixedThreshold(t)."
        )
    if not isinstance(overlap, int) or (
        not isinstance(overlap, bool) and not 0 <= overlap <= sync_every
    ):
        raise (ValueError if isinstance(overlap, int) else TypeError)(
            f"Expect `overlap` to be a bool or an int in [0, sync_every={sync_every}] (the inner "
            f"steps each sync's exchange runs in the background), got {overlap!r}: pass e.g. "
            "overlap=2, or overlap=True to merge at the next sync."
        )
    count = sum(1 for _ in model.parameters())
    if not count:
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
    if (
        isinstance(fragments, bool)
        or not isinstance(fragments, int)
        or not (1 <= fragments <= min(sync_every, count))
    ):
        raise ValueError(
            f"Expect `fragments` to be an int from 1 to {min(sync_every, count)} (at most "
            f"sync_every={sync_every} and the model's {count} parameter tensors), got "
            f"{fragments!r}: pass e.g. fragments=1 (the whole model at each sync)."
        )
    gap = sync_every // fragments  # the fewest steps between two fragments' syncs
    if fragments > 1 and _overlap_steps(overlap, sync_every) > gap:
        raise ValueError(
            f"Expect `overlap` of at most {gap} steps with fragments={fragments} and "
            f"sync_every={sync_every} (a fragment's round must be merged before the next "
            f"fragment's sync), got {overlap!r}: lower `overlap` or `fragments`."
        )
