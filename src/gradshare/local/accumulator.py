"""N parties sharing encoded updates: queues, barrier, external source, errors (docs/design.md §5).

The port of DL4J's ``EncodedGradientsAccumulator``. Each party (a worker thread with its own
replica) stores its update, which is encoded by that party's :class:`~gradshare.Encoder` and put
into every party's queue, its own included; the active parties then meet at a barrier, and each
applies the same decoded sum to its replica. Unlike DL4J, messages are decoded in party order
(so replicas stay bit-identical), residuals survive epochs and checkpoints, queues are bounded
with a clear error, and a failing party makes every other one raise instead of hang.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from gradshare import codec
from gradshare._checks import check_int
from gradshare.codec.flat import views
from gradshare.encoding.encoder import Encoder, EncodeStats
from gradshare.encoding.options import EncodingOptions, encoding_options
from gradshare.local.tail import IndexedTail

__all__ = [
    "AccumulatorError",
    "EncodedGradientsAccumulator",
    "optimal_buffer_size",
]

DEFAULT_QUEUE_SIZE = 2
"""Rounds of messages a party's queue holds when no ``queue_size`` is given (DL4J's default)."""


def optimal_buffer_size(num_params: int, num_workers: int, queue_size: int) -> int:
    """Bytes of message buffer DL4J reserves: ``((N // 16) + 65536) · workers · queue · 4``.

    A bitmap message of N elements is N//16 + 5 int32 words, so this holds ``queue_size`` full
    messages per worker with room to spare.
    """
    for name, value in (
        ("num_params", num_params),
        ("num_workers", num_workers),
        ("queue_size", queue_size),
    ):
        check_int(value, name)
    return ((num_params // 16) + 65536) * num_workers * queue_size * 4


class AccumulatorError(RuntimeError):
    """Another party failed (or timed out); ``__cause__`` is its original exception."""


class EncodedGradientsAccumulator:
    """Share threshold-encoded updates among ``num_parties`` local parties.

    One round, for each active party ``p`` (each in its own thread):

    1. ``store_update(p, u, iteration)`` adds ``u`` into ``p``'s residual, encodes it and puts
       the message into every party's queue; then ``p`` waits for the other active parties;
    2. ``apply_update(p, params)`` decodes, in party order, every message of the rounds ``p``
       has not applied (and the external source's unread updates) into a zeroed buffer and
       steps ``params -= buffer`` (``buffer / active parties`` with ``reduction="mean"``).

    So every replica applies ``Σ_w decode(m_w)`` and ``residual_w ← residual_w + u_w -
    decode(m_w)``. With ``dense=True`` the exact dense updates are shared instead (the
    oracle that the encoded mode is compared to).

    Args:
        num_parties: how many parties (workers) there are.
        queue_size: rounds of messages each queue may hold before ``store_update`` raises
            (default 2, as DL4J); DL4J sizes this memory as :func:`optimal_buffer_size`.
        options: the encoding settings (:class:`~gradshare.EncodingOptions`), or give its
            fields as keywords: ``threshold`` (cloned for each party), ``post_processor``
            (cloned for each party), ``boundary``, ``magnitude``, ``dense`` (share the exact
            dense updates: the oracle), ``reduction`` (``"sum"`` by default, as DL4J; or
            ``"mean"`` over the active parties), ``timeout`` (how long a party waits for the
            others).
    """

    def __init__(
        self,
        num_parties: int,
        *,
        queue_size: int | None = None,
        options: EncodingOptions | None = None,
        **encoding: Any,
    ) -> None:
        check_int(num_parties, "num_parties")
        self.options = encoding_options(options, encoding, "EncodedGradientsAccumulator")
        queue_size = DEFAULT_QUEUE_SIZE if queue_size is None else queue_size
        check_int(queue_size, "queue_size")
        self.num_parties = num_parties
        self.dense = self.options.dense
        self.encoders: list[Encoder] | None = None
        if not self.dense:
            self.encoders = [self.options.encoder() for _ in range(num_parties)]
        self.queue_size = queue_size
        self.reduction = self.options.reduce("sum")
        self.timeout = self.options.seconds()
        self._lock = threading.Lock()
        self._queues: list[list[tuple[int, int, torch.Tensor]]] = [[] for _ in range(num_parties)]
        self._buffers: list[torch.Tensor | None] = [None] * num_parties
        """Per party, the decoded sum when it cannot go straight into the parameters."""
        self._scratch: list[torch.Tensor | None] = [None] * num_parties
        """Per party, zeros for :func:`gradshare.codec.subtract_sum_`."""
        self._external: IndexedTail | None = None
        self._bypass = False
        self._consumers = num_parties
        self._round = 0
        self._error: BaseException | None = None
        self._failed_party: int | None = None
        self._barrier = self._new_barrier(num_parties)
        self.last_stats: list[EncodeStats | None] = [None] * num_parties
        """Per party, the stats of its last :meth:`store_update` (None in dense mode)."""
        self.bytes_sent = [0] * num_parties
        """Per party, bytes of all messages it stored (dense mode: 4 per element)."""
        self.timings = {"encode": [0.0] * num_parties, "apply": [0.0] * num_parties}
        """Per party, seconds spent encoding and decoding+applying, summed over calls."""

    # ------------------------------------------------------------------ round set-up

    def _new_barrier(self, parties: int) -> threading.Barrier:
        return threading.Barrier(parties, action=self._next_round)

    def _next_round(self) -> None:
        self._round += 1

    def register_consumers(self, n: int) -> None:
        """Set how many parties (0 .. n-1) take part in the coming rounds; call between rounds."""
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.num_parties:
            raise ValueError(f"Expect `n` in 1..{self.num_parties} active parties, got {n!r}.")
        if n != self._consumers:
            self._barrier = self._new_barrier(n)
            self._consumers = n

    def fallback_to_single_consumer_mode(self, enabled: bool) -> None:
        """Skip the barrier (one party only): each store is its own round."""
        self._bypass = bool(enabled)

    def set_external_source(self, tail: IndexedTail | None) -> None:
        """Also apply ``tail``'s updates (from other nodes); party ``p`` reads as consumer ``p``."""
        if tail is not None and tail.expected_consumers < self.num_parties:
            raise ValueError(
                f"Expect a tail with >= {self.num_parties} consumers (one per party), got "
                f"{tail.expected_consumers}."
            )
        self._external = tail

    # ------------------------------------------------------------------ errors

    def fail(self, party: int | None, error: BaseException) -> None:
        """Record ``error`` as the round's failure and wake every waiting party."""
        with self._lock:
            if self._error is None:
                self._error, self._failed_party = error, party
        self._barrier.abort()

    def _raise_if_failed(self, party: int) -> None:
        error = self._error
        if error is not None:
            who = "a party" if self._failed_party is None else f"party {self._failed_party}"
            raise AccumulatorError(
                f"Party {party} stopped because {who} failed: {type(error).__name__}: {error}"
            ) from error

    def _guarded(self, party: int, fn: Any, *args: Any) -> Any:
        self._raise_if_failed(party)
        try:
            return fn(*args)
        except AccumulatorError:
            raise
        except BaseException as e:
            self.fail(party, e)
            raise

    # ------------------------------------------------------------------ a round

    def _check_party(self, party: int) -> None:
        if isinstance(party, bool) or not isinstance(party, int):
            raise TypeError(f"Expect `party` to be an int, got {type(party).__name__}.")
        if not 0 <= party < self.num_parties:
            raise ValueError(f"Expect `party` in 0..{self.num_parties - 1}, got {party}.")

    def store_update(
        self,
        party: int,
        update: torch.Tensor,
        iteration: int,
        epoch: int = 0,
        *,
        finite: bool = False,
    ) -> torch.Tensor | None:
        """Encode ``party``'s update, queue the message for every party, wait for the round.

        ``finite=True`` tells the encoder the update was already checked to be finite
        (:func:`gradshare.codec.take_update_`), so it is not read once more to check.

        Returns the message (None when nothing crossed the threshold; the dense copy in dense
        mode). Raises :class:`AccumulatorError` if another party failed, ``TimeoutError`` if
        the others did not arrive within ``timeout``.
        """
        self._check_party(party)
        message = self._guarded(party, self._store, party, update, iteration, epoch, finite)
        if self._bypass:
            with self._lock:
                self._round += 1
            return message
        try:
            self._barrier.wait(self.timeout)
        except threading.BrokenBarrierError:
            self._raise_if_failed(party)
            error = TimeoutError(
                f"Party {party} waited {self.timeout:g} s for {self._consumers} parties at the "
                "round's barrier: a party is stuck or gone. Raise `timeout` if steps are slow."
            )
            self.fail(party, error)
            raise error from None
        return message

    def _store(
        self, party: int, update: torch.Tensor, iteration: int, epoch: int, finite: bool
    ) -> torch.Tensor | None:
        start = time.perf_counter()
        message: torch.Tensor | None
        if self.encoders is None:
            flat = update.detach().reshape(-1)
            codec.check_vector(flat, "update")
            message = flat.to(torch.float32, copy=True)
        else:
            message = self.encoders[party].encode(update, iteration, epoch, finite=finite)
            self.last_stats[party] = self.encoders[party].last_stats
        with self._lock:
            cap = self.queue_size * self.num_parties
            full = [p for p, q in enumerate(self._queues) if len(q) >= cap]
            if full:
                raise RuntimeError(
                    f"The queue of party {full[0]} holds {cap} messages (`queue_size`="
                    f"{self.queue_size} rounds of {self.num_parties} parties): it has not "
                    "applied its updates. Call apply_update for every party each round, or "
                    "raise `queue_size` (DL4J reserves optimal_buffer_size(num_params, "
                    "num_workers, queue_size) bytes for these messages)."
                )
            if message is not None:
                for q in self._queues:
                    q.append((self._round, party, message))
                self.bytes_sent[party] += message.numel() * 4
        self.timings["encode"][party] += time.perf_counter() - start
        return message

    def apply_update(self, party: int, params: torch.Tensor | Sequence[torch.Tensor]) -> int:
        """Step ``params -= Σ decoded`` for every round ``party`` has not applied; return count.

        ``params`` is the flat parameter vector or a sequence of tensors whose sizes add up to
        the update's (filled in order). Messages are decoded in round, then party, order.
        """
        self._check_party(party)
        return int(self._guarded(party, self._apply, party, params))

    def _apply(self, party: int, params: torch.Tensor | Sequence[torch.Tensor]) -> int:
        start = time.perf_counter()
        tensors = [params] if isinstance(params, torch.Tensor) else list(params)
        numel = sum(p.numel() for p in tensors)
        with self._lock:
            ready = sorted(
                (m for m in self._queues[party] if m[0] < self._round), key=lambda m: m[:2]
            )
        external = self._external is not None and self._external.has_anything(party)
        if not ready and not external:
            return 0
        device = tensors[0].device
        messages = [m.to(device) for _, _, m in ready]
        names = [f"party {p} (round {r})" for r, p, _ in ready]
        divisor = self._consumers if self.reduction == "mean" else 1
        # a fault raises before anything is written: params and queue stay untouched
        if self.encoders is not None and not external and len(tensors) == 1:
            flat = tensors[0].detach().reshape(-1)
            scratch = _zeros(self._scratch, party, flat.numel(), flat.dtype, device)
            codec.subtract_sum_(
                messages, flat, scratch, divisor=divisor, names=names, checked=True
            )  # made by this accumulator's encoders (or validated as a checkpoint loaded)
            if flat.data_ptr() != tensors[0].data_ptr():  # a non-contiguous tensor: a copy
                tensors[0].detach().copy_(flat.view_as(tensors[0]))
        else:
            buffer = _zeros(self._buffers, party, numel, torch.float32, device)
            if self.encoders is not None:
                codec.decode_sum_(messages, buffer, names=names, checked=True)
            else:
                for message in messages:
                    if message.numel() != numel:
                        raise ValueError(
                            f"Expect params of {message.numel()} elements (the updates'), got "
                            f"{numel}."
                        )
                buffer.zero_()
                for message in messages:
                    buffer.add_(message)
            if external:
                assert self._external is not None
                self._external.drain_to(party, buffer)
            if divisor != 1:
                buffer.div_(divisor)
            with torch.no_grad():
                for p, piece in views(buffer, tensors):
                    p.sub_(piece)
        with self._lock:
            taken = {id(m) for m in ready}
            self._queues[party] = [m for m in self._queues[party] if id(m) not in taken]
        self.timings["apply"][party] += time.perf_counter() - start
        return len(ready)

    def has_anything(self, party: int) -> bool:
        """Whether ``party`` has queued messages or unread external updates."""
        self._check_party(party)
        with self._lock:
            if self._queues[party]:
                return True
        return self._external is not None and self._external.has_anything(party)

    def reset(self, *, residuals: bool = False) -> None:
        """Clear queues, the recorded failure and the barrier (and the residuals if asked).

        Residuals are kept by default, so that what was not sent in one ``fit`` is sent in the
        next (DL4J drops them).
        """
        with self._lock:
            self._queues = [[] for _ in range(self.num_parties)]
            self._error = self._failed_party = None
            self._barrier = self._new_barrier(self._consumers)
            if residuals and self.encoders is not None:
                for enc in self.encoders:
                    if enc.residual is not None:
                        enc.residual.zero_()

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        """Every party's encoder state, queued messages, round and byte counters."""
        with self._lock:
            return {
                "num_parties": self.num_parties,
                "dense": self.dense,
                "encoders": None
                if self.encoders is None
                else [e.state_dict() for e in self.encoders],
                "queues": [[(r, p, m.clone()) for r, p, m in q] for q in self._queues],
                "round": self._round,
                "bytes_sent": list(self.bytes_sent),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; on a mismatch raise and change nothing."""
        if state.get("num_parties") != self.num_parties or state.get("dense") != self.dense:
            raise ValueError(
                f"Checkpoint is of {state.get('num_parties')} parties (dense="
                f"{state.get('dense')}), this accumulator has {self.num_parties} (dense="
                f"{self.dense}): build it with the same settings."
            )
        if self.encoders is not None:
            probes = [copy.deepcopy(e) for e in self.encoders]
            for probe, saved in zip(probes, state["encoders"], strict=True):
                probe.load_state_dict(saved)
            for enc, saved in zip(self.encoders, state["encoders"], strict=True):
                enc.load_state_dict(saved)
        for q in state["queues"] if self.encoders is not None else []:
            for _, p, m in q:  # applied later without another check: check them now
                try:
                    codec.check_message(m, int(m[1]) if m.numel() > 1 else 0)
                except codec.MessageError as e:
                    raise ValueError(
                        f"Checkpoint holds an invalid message of party {p}: {e}"
                    ) from None
        with self._lock:
            self._queues = [[(r, p, m.clone()) for r, p, m in q] for q in state["queues"]]
            self._round = int(state["round"])
            self.bytes_sent = list(state["bytes_sent"])


def _zeros(
    store: list[torch.Tensor | None], party: int, numel: int, dtype: torch.dtype, device: Any
) -> torch.Tensor:
    """``store[party]``, (re)made as zeros when it does not fit ``numel``, ``dtype``, ``device``."""
    buffer = store[party]
    if (
        buffer is None
        or buffer.numel() != numel
        or buffer.dtype != dtype
        or buffer.device != device
    ):
        buffer = store[party] = torch.zeros(numel, dtype=dtype, device=device)
    return buffer
