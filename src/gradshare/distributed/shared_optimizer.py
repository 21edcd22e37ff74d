"""Update sharing over torch.distributed: SharedOptimizer (docs/design.md §6).

Each rank's own optimizer steps on its local gradient; the update it made is threshold-encoded
with error feedback, the messages of all ranks are exchanged (:mod:`gradshare.distributed.exchange`:
int32 messages all-gathered, nothing pickled, each validated whole before any element is decoded),
and every rank applies the same decoded sum, so the replicas stay bit-identical.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

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
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

from gradshare import codec
from gradshare.codec.flat import views
from gradshare.distributed.agreement import agree
from gradshare.distributed.buffers import BufferSync
from gradshare.distributed.checkpoint import (
    check_counter,
    check_encoder_state,
    check_format,
    check_mapping,
    check_optimizer_state,
    check_saved_by,
    saved_by,
)
from gradshare.distributed.exchange import (
    PrivateGroup,
    collective,
    exchange_messages,
    rank_names,
    take_back,
)
from gradshare.distributed.hosts import count_ranks_on_host
from gradshare.distributed.metrics import share_metrics, warn_once
from gradshare.distributed.nodes import HierarchicalExchange, node_layout
from gradshare.distributed.wrapper import OptimizerWrapper
from gradshare.encoding.encoder import Encoder, EncodeStats
from gradshare.encoding.options import EncodingOptions, encoding_options

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

__all__ = ["SharedOptimizer"]

logger = logging.getLogger(__name__)


_KEY = "gradshare"
"""The key of gradshare's own entries in :meth:`SharedOptimizer.state_dict`."""

FORMAT = 2
"""The version of gradshare's entries in :meth:`SharedOptimizer.state_dict` (1: gradshare 0.1,
which recorded none; it reads the same)."""


def _split_state(state_dict: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the wrapped optimizer's state dict, gradshare's entries) of either schema."""
    state_dict = check_mapping(state_dict, "a SharedOptimizer state dict")
    if _KEY in state_dict:
        ours = check_mapping(state_dict[_KEY], f"the state dict's {_KEY!r} entry")
        return {k: v for k, v in state_dict.items() if k != _KEY}, ours
    if {"optimizer", "encoder", "iteration", "bytes_sent", "numel"} <= set(state_dict):
        return check_mapping(state_dict["optimizer"], "`optimizer`"), state_dict  # gradshare 0.1
    raise ValueError(
        f"Expect a SharedOptimizer state dict (with a {_KEY!r} entry), got keys "
        f"{sorted(state_dict)}: a plain optimizer's checkpoint holds no residual; load it "
        "into the wrapped optimizer before wrapping it."
    )


def _flat_params(params: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    for p, piece in views(out, params):
        piece.copy_(p.detach())
    return out


def _check_ddp(ddp: Any, optimizer: torch.optim.Optimizer) -> None:
    """Refuse a ``ddp=`` that is not a DDP model, or one with trained parameters that the
    optimizer does not hold (their gradients would stay local and never be shared)."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(
            f"Expect `ddp` to be a DistributedDataParallel model, got {type(ddp).__name__}: "
            "without DDP, leave `ddp` out (SharedOptimizer alone shares the updates)."
        )
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    missing = [n for n, p in ddp.module.named_parameters() if p.requires_grad and id(p) not in held]
    if missing:
        raise ValueError(
            f"Expect the optimizer to hold every trained parameter of the DDP model, but "
            f"{len(missing)} are not in it (first: {missing[0]!r}): with `ddp=` their "
            "gradients are no longer all-reduced, so give the optimizer all of them."
        )


class SharedOptimizer(OptimizerWrapper):
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
        process_group: the group to share over (default: the world).
        options: the encoding settings (:class:`~gradshare.EncodingOptions`), or give its
            fields as keywords: ``threshold`` (cloned; each rank keeps its own state),
            ``post_processor``, ``boundary``, ``magnitude`` (what each sent entry carries:
            t, or the mean magnitude of the sent elements), ``dense`` (all-reduce the exact
            dense updates instead: the oracle), ``reduction`` (``"sum"``, DL4J's, or
            ``"mean"`` over ranks; by default ``"mean"`` with ``ddp=``, since DDP averaged
            the gradients and the learning rate tuned for it stays right, else ``"sum"``),
            ``timeout`` (how long a collective may wait for the other ranks).
        model: the model these parameters belong to, when it is not in DDP: its buffers
            (BatchNorm's running statistics and the like, which each replica's forward
            passes write) are made rank 0's after every step, as DDP does before every
            forward, and only where they differ (:class:`~gradshare.distributed.buffers.
            BufferSync`). Without it, or with ``broadcast_buffers=False``, buffers stay each
            rank's own. With ``ddp=``, DDP syncs them (its ``broadcast_buffers``).
        broadcast_buffers: make ``model``'s buffers alike at every step (default True).
        ddp: the ``DistributedDataParallel`` model these parameters belong to, for a model
            that stays wrapped in DDP (Lightning, accelerate, code that expects it). Its
            gradient all-reduce is replaced by a hook that leaves every gradient local (no
            communication), so the optimizer steps on this rank's own gradient and the update
            is shared, exactly as without DDP. The one-line change for AdamW users of DDP:
            ``opt = SharedOptimizer(opt, ddp=ddp_model)``. ``process_group`` defaults to
            the DDP model's.
        hierarchical: exchange in two levels, for several ranks per machine: ``True`` takes
            the ranks per machine (node) from ``LOCAL_WORLD_SIZE`` (torchrun sets it), a
            number gives them; the ranks of a node must be consecutive (as torchrun numbers
            them) and every node the same size. Each step, the ranks of a node all-reduce
            their updates densely (sum) over the fast local link; every rank of the node adds
            that node update into the node's residual with an identical encoder (so each rank's
            checkpoint holds its node's residual), only the node leaders (first rank of each)
            exchange their encoded messages across nodes, and each leader broadcasts them to
            its node, where every rank validates and applies them in node order. The sum is
            over all ranks' updates, as in the flat exchange (``"mean"`` divides by the world
            size). The link between machines then carries one message per node, not one per
            rank (DL4J's one message per node). ``bytes_sent`` counts what a leader sent
            across nodes (0 on the other ranks).

    Example::

        >>> model = torch.nn.Linear(10, 1)  # doctest: +SKIP
        >>> opt = SharedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))  # doctest: +SKIP
        >>> loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()  # doctest: +SKIP
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        process_group: dist.ProcessGroup | None = None,
        model: torch.nn.Module | None = None,
        broadcast_buffers: bool = True,
        ddp: DistributedDataParallel | None = None,
        hierarchical: bool | int = False,
        options: EncodingOptions | None = None,
        **encoding: Any,
    ) -> None:
        super().__init__(optimizer)
        self.options = encoding_options(options, encoding, "SharedOptimizer")
        algorithm = self.options.algorithm()
        reduction = self.options.reduce("sum" if ddp is None else "mean")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "SharedOptimizer needs a process group: call "
                "torch.distributed.init_process_group() first (torchrun sets the environment)."
            )
        if ddp is not None:
            _check_ddp(ddp, optimizer)
            if process_group is None:
                process_group = ddp.process_group
        self.group = process_group
        self.reduction = reduction
        self.timeout = timedelta(seconds=self.options.seconds())
        self._private = PrivateGroup(process_group, self.timeout)
        """Where the exchanges run: gloo ends a stuck one at this optimizer's timeout."""
        self.encoder = None if algorithm is None else self.options.encoder()
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
        if hierarchical is not False and algorithm is None:
            raise ValueError(
                "`hierarchical` needs encoded updates: with `dense=True` the flat all-reduce "
                "already is the dense exchange."
            )
        synced = model if model is not None and ddp is None and broadcast_buffers else None
        self._buffers = BufferSync(synced or torch.nn.Module(), self._private, self.device)
        """``model``'s buffers, made rank 0's after every step (none with ``ddp=``)."""
        agree(
            self._settings(hierarchical),
            group=self._private.get(),
            timeout=self.timeout,
            what="SharedOptimizer",
            device=self.device,
        )
        self.nodes = node_layout(hierarchical, process_group, self._private.get(), self.timeout)
        """The nodes of the hierarchical exchange (None: flat, every rank's message)."""
        self._hierarchy: HierarchicalExchange | None = None
        if self.nodes is not None:
            self._hierarchy = HierarchicalExchange(
                self.nodes, self.numel, self.timeout, self.device
            )
        self._before = torch.empty(self.numel, dtype=params[0].dtype, device=self.device)
        self._update = torch.empty_like(self._before)
        self._scratch = torch.zeros_like(self._before)
        """Zeros, for :func:`gradshare.codec.subtract_sum_`."""
        count_ranks_on_host(self._private.get())  # the kernels' share of the host
        self._broadcast_from_rank0(params)
        self._buffers.sync()
        world = dist.get_world_size(process_group)
        if self.options.reduction is None and reduction == "sum" and world > 2:
            warn_once(
                logger,
                "shared-sum",
                f"SharedOptimizer sums the {world} ranks' updates (reduction 'sum' by "
                f"default without `ddp=`): each step moves {world}x as far as one rank's "
                f"optimizer would, so a learning rate tuned for one process overshoots. "
                f"Divide the learning rate by {world}, or pass reduction='mean' (pass "
                "reduction='sum' to keep the sum and silence this).",
            )
        if ddp is not None:
            ddp.register_comm_hook(None, noop_hook)  # every gradient stays local
        logger.info(
            "SharedOptimizer over %s: %d parameter tensors, %d elements, world %d, %s, "
            "reduction %s, %s exchange",
            type(optimizer).__name__,
            len(params),
            self.numel,
            world,
            "dense" if algorithm is None else algorithm,
            reduction,
            "flat" if self.nodes is None else f"hierarchical ({self.nodes.num_nodes} nodes)",
        )

    # ------------------------------------------------------------------ set-up

    def _settings(self, hierarchical: bool | int) -> dict[str, Any]:
        """What every rank must agree on (:func:`~gradshare.distributed.agreement.agree`):
        what changes the sum or the wire. Each rank's optimizer state is its own."""
        if hierarchical is True:  # the node size it resolves to
            raw = os.environ.get("LOCAL_WORLD_SIZE", "")
            hierarchical = int(raw) if raw.isdigit() else True
        settings: dict[str, Any] = {
            "numel": self.numel,
            "reduction": self.reduction,
            "dense": self.options.dense,
            "hierarchical": hierarchical,
            "buffers": self._buffers.layout(),
        }
        if self.encoder is not None:
            o = self.options
            settings.update(
                threshold=self.encoder.algorithm,
                magnitude=o.magnitude,
                boundary=o.boundary,
                post_processor=o.post_processor,
            )
        return settings

    @torch.no_grad()
    def _broadcast_from_rank0(self, params: list[torch.Tensor]) -> None:
        rank = dist.get_rank()
        exchange_messages(
            None, self.numel, group=self._private.get(), timeout=self.timeout, device=self.device
        )
        flat = _flat_params(params, self._before)
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        collective(
            dist.broadcast,
            flat,
            src=src,
            group=self._private.get(),
            timeout=self.timeout,
            what="parameter broadcast",
            rank=rank,
        )
        self._unflatten(flat, params)

    @staticmethod
    def _unflatten(flat: torch.Tensor, params: list[torch.Tensor]) -> None:
        for p, piece in views(flat, params):
            p.copy_(piece)

    # ------------------------------------------------------------------ optimizer API

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
        sent = self.bytes_sent
        message: torch.Tensor | None = None
        failure: BaseException | None = None
        loss = None
        try:
            loss = self._local_step(closure)
            update = codec.take_update_(before, _flat_params(params, self._update), self._update)
            if self.encoder is not None and self.nodes is None:
                message = self.encoder.encode(update, self.iteration, finite=True)
                self.last_stats = self.encoder.last_stats
        except Exception as e:  # tell the other ranks before raising here
            failure = e
        try:
            if self.encoder is None:
                self._dense_step(before, failure)
            elif self._hierarchy is not None:
                self._share_hierarchical(before, failure)
            else:
                self._share(message, before, failure)
                self.bytes_sent += 0 if message is None else message.numel() * 4
        finally:  # the parameters before the local step, minus the shared sum if it applied
            self._unflatten(before, params)
        self._buffers.sync()
        logger.debug(
            "SharedOptimizer step %d: sent %d bytes", self.iteration, self.bytes_sent - sent
        )
        self.iteration += 1
        return loss

    _step_supports_amp_scaling = True
    """``torch.amp.GradScaler`` calls :meth:`step` even when this rank's gradients overflowed
    (telling it through ``found_inf`` and ``grad_scale``), instead of skipping it: the other
    ranks' gradients are their own and did not overflow, so every rank must still take part in
    the exchange. Only the local update is skipped (see :meth:`_local_step`)."""

    def _local_step(self, closure: Callable[[], float] | None) -> float | None:
        """The wrapped optimizer's step, or none when a GradScaler found inf/NaN gradients;
        gradients the scaler left scaled are unscaled first, as its ``unscale_`` would."""
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and bool(found_inf.item() > 0):
            return None  # the update is zero; this rank still joins the exchange
        grad_scale = getattr(self, "grad_scale", None)
        if grad_scale is not None:
            inv = grad_scale.double().reciprocal().float()
            for p in self._params():
                if p.grad is not None:
                    p.grad.mul_(inv.to(p.grad.device))
        with torch.enable_grad():
            return self.optim.step(closure)

    def _share(
        self, message: torch.Tensor | None, before: torch.Tensor, failure: BaseException | None
    ) -> None:
        """Exchange, validate, and step ``before -= Σ decoded / divisor``. If the exchange or
        a peer's message fails, this rank's own message goes back into its residual (the
        parameters are put back too): nothing of it is lost for a job that catches the error,
        checkpoints and resumes."""
        group = self._private.get()
        try:
            messages = exchange_messages(
                message,
                self.numel,
                group=group,
                timeout=self.timeout,
                device=self.device,
                failure=failure,
                round=self.iteration,
            )
            codec.subtract_sum_(
                messages,
                before,
                self._scratch,
                divisor=self._divisor(),
                names=rank_names(len(messages), group),
            )
        except BaseException:
            if message is not None and self.encoder is not None:
                take_back(message, self.encoder.residual)  # type: ignore[arg-type]
            raise

    def _share_hierarchical(self, before: torch.Tensor, failure: BaseException | None) -> None:
        """The two-level exchange (:class:`~gradshare.distributed.nodes.HierarchicalExchange`)."""
        assert self._hierarchy is not None and self.encoder is not None

        def sent(n: int) -> None:
            self.bytes_sent += n

        try:
            self._hierarchy.share(
                self._update,
                before,
                self._scratch,
                self.encoder,
                failure,
                iteration=self.iteration,
                divisor=self._divisor(),
                sent=sent,
            )
        finally:
            if self.encoder.last_stats is not None:
                self.last_stats = self.encoder.last_stats

    def _divisor(self) -> int:
        return dist.get_world_size(self.group) if self.reduction == "mean" else 1

    def _dense_step(self, before: torch.Tensor, failure: BaseException | None) -> None:
        """The oracle: all-reduce the exact update (after the same status and size check)."""
        exchange_messages(
            None,
            self.numel,
            group=self._private.get(),
            timeout=self.timeout,
            device=self.device,
            failure=failure,
            round=self.iteration,
        )
        collective(
            dist.all_reduce,
            self._update,
            group=self._private.get(),
            timeout=self.timeout,
            what="dense all-reduce",
            rank=dist.get_rank(),
        )
        before.sub_(self._update.div_(self._divisor()))
        self.bytes_sent += 4 * self.numel

    # ------------------------------------------------------------------ stats

    @property
    def dense_bytes(self) -> int:
        """Bytes the same steps' updates take sent dense in float32."""
        return 4 * self.numel * self.iteration

    def metrics(self) -> dict[str, float]:
        """``bytes_sent``, ``dense_bytes``, ``compression``, ``density``, ``threshold``
        (:func:`~gradshare.distributed.metrics.share_metrics`)."""
        return share_metrics(
            self.bytes_sent, self.dense_bytes, [self.last_stats], encoded=not self.options.dense
        )

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's ``state_dict()`` (torch's schema: ``state`` and
        ``param_groups``), plus this rank's residual, threshold state and counters under the
        key ``"gradshare"``: every rank saves its own."""
        saved = self.optim.state_dict()
        saved[_KEY] = {
            "format": FORMAT,
            "encoder": None if self.encoder is None else self.encoder.state_dict(),
            "iteration": self.iteration,
            "bytes_sent": self.bytes_sent,
            "numel": self.numel,
            "hierarchical": None if self.nodes is None else self.nodes.node_size,
            **saved_by(self.group),
        }
        return saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore this rank's :meth:`state_dict`; on any mismatch or junk raise a
        ``ValueError`` naming the field, and change nothing: everything is checked first.

        Also reads the schema of gradshare 0.1 (``{"optimizer": ..., "encoder": ...}``).
        """
        optim_state, ours = _split_state(state_dict)
        self._check_ours(ours)
        check_optimizer_state(self.optim, optim_state, "SharedOptimizer state")
        if self.encoder is not None:  # everything that can refuse runs before any change
            enc = self.encoder
            probe = Encoder(enc.algorithm.clone(), enc.post_processor, magnitude=enc.magnitude)
            probe.load_state_dict(ours["encoder"])
        self.optim.load_state_dict(optim_state)  # checks everything before it changes
        if self.encoder is not None:
            self.encoder.load_state_dict(ours["encoder"])
        self.iteration = ours["iteration"]
        self.bytes_sent = ours["bytes_sent"]

    def _check_ours(self, ours: dict[str, Any]) -> None:
        """Refuse gradshare's entries of a state dict unless every one fits this optimizer."""
        what = "SharedOptimizer state"
        check_format(ours, what, FORMAT)
        if ours.get("numel") != self.numel:
            raise ValueError(
                f"Checkpoint shares {ours.get('numel')} elements, this optimizer "
                f"{self.numel}: it is of another model."
            )
        check_saved_by(ours, self.group, "Checkpoint")
        mode = None if self.nodes is None else self.nodes.node_size
        if ours.get("hierarchical") != mode:
            raise ValueError(
                f"Checkpoint was saved with hierarchical={ours.get('hierarchical')} (ranks per "
                f"node; None: flat), this optimizer has {mode}: a node residual and a rank's "
                "residual are different books; resume in the mode that saved it."
            )
        check_counter(ours, "iteration", what)
        check_counter(ours, "bytes_sent", what)
        if "encoder" not in ours:
            raise ValueError(f"{what} is missing `encoder`: the checkpoint is corrupted.")
        if (ours["encoder"] is None) != (self.encoder is None):
            raise ValueError("Checkpoint and optimizer differ in mode (encoded vs `dense=True`).")
        if self.encoder is not None:
            check_encoder_state(ours["encoder"], self.numel, what)

    def __repr__(self) -> str:
        algorithm = None if self.encoder is None else self.encoder.algorithm
        return f"SharedOptimizer({self.optim!r}, threshold={algorithm!r})"
