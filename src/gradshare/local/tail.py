"""IndexedTail: updates from outside (other nodes), read by every local consumer.

See docs/design.md §5.

The port of DL4J's ``IndexedTail``. Updates that arrive from other nodes are appended once;
each local consumer has its own read position and :meth:`IndexedTail.drain_to` adds everything
it has not yet applied. Entries that every consumer has read are freed. With collapsing on,
:meth:`IndexedTail.put` keeps the entries that no consumer has read bounded, as DL4J does: once
:data:`COLLAPSE_AT` of them pile up they are summed into one dense entry, and later puts are
added into that entry until some consumer reads it. So a tail nobody drains costs the memory of
one vector instead of a growing list.
"""

from __future__ import annotations

import threading

import torch

from gradshare import codec

__all__ = ["COLLAPSE_AT", "IndexedTail"]

COLLAPSE_AT = 32
"""Entries unread by every consumer at which a put (or :meth:`IndexedTail.maybe_collapse`) sums
them into one dense entry."""


class IndexedTail:
    """A thread-safe append-only log of updates with one read position per consumer.

    Each :meth:`put` appends an encoded message (validated whole on arrival, so a bad one is
    refused before it is stored) or a dense vector (copied as float32). Consumer ``c`` (an int
    in ``0 .. expected_consumers - 1``) reads with :meth:`drain_to`, which adds every entry it
    has not read, in arrival order, into a target vector.

    Args:
        expected_consumers: how many consumers read this tail.
        allow_collapse: sum entries that no consumer has read yet into one dense entry once
            :data:`COLLAPSE_AT` of them pile up, checked on every put; while no consumer has
            read that entry, further puts are added into it. Every consumer still drains
            exactly the same total, to float rounding of the summation order.
        numel: the vector length; None to take it from the first put.

    Example::

        >>> import torch
        >>> from gradshare import IndexedTail
        >>> tail = IndexedTail(2)
        >>> tail.put(torch.ones(3))
        >>> target = torch.zeros(3)
        >>> tail.drain_to(0, target), target.tolist(), tail.delta(1)
        (True, [1.0, 1.0, 1.0], 1)
    """

    def __init__(
        self, expected_consumers: int, *, allow_collapse: bool = False, numel: int | None = None
    ) -> None:
        if isinstance(expected_consumers, bool) or not isinstance(expected_consumers, int):
            raise TypeError(
                "Expect `expected_consumers` to be an int, got "
                f"{type(expected_consumers).__name__}."
            )
        if expected_consumers < 1:
            raise ValueError(f"Expect `expected_consumers` >= 1, got {expected_consumers}.")
        if numel is not None and not (1 <= numel <= codec.MAX_NUMEL):
            raise ValueError(f"Expect `numel` in 1..{codec.MAX_NUMEL} or None, got {numel}.")
        self.expected_consumers = expected_consumers
        self.allow_collapse = bool(allow_collapse)
        self.numel = numel
        self._lock = threading.Lock()
        self._entries: list[torch.Tensor] = []
        self._base = 0  # global index of self._entries[0]
        self._positions = [0] * expected_consumers  # global index of each consumer's next read
        self._collapsed: int | None = None  # global index of the last collapsed entry, if any

    # ------------------------------------------------------------------ writing

    def put(self, update: torch.Tensor) -> None:
        """Append an int32 message or a dense floating vector (copied).

        Raises:
            MessageError: an int32 message that fails validation (nothing is stored).
            ValueError, TypeError: a vector of the wrong length or kind.
        """
        if not isinstance(update, torch.Tensor):
            raise TypeError(f"Expect a message or dense tensor, got {type(update).__name__}.")
        if update.dtype == torch.int32:
            numel = self.numel if self.numel is not None else codec.message_info(update).numel
            codec.check_message(update, numel)
            entry = update.detach().clone()
        else:
            flat = update.detach().reshape(-1)
            codec.check_vector(flat, "update")
            numel = flat.numel()
            if self.numel is not None and numel != self.numel:
                raise ValueError(
                    f"Expect a dense update of {self.numel} elements, got {numel}: "
                    "every entry of a tail is for the same vector."
                )
            entry = flat.to(torch.float32, copy=True)
        with self._lock:
            if self.numel is None:
                self.numel = numel
            elif numel != self.numel:
                raise ValueError(f"Expect a message for {self.numel} elements, got {numel}.")
            if self.allow_collapse and self._unread_collapsed_locked():
                _add_(self._entries[-1], entry)
                return
            self._entries.append(entry)
            self._collapse_locked()

    # ------------------------------------------------------------------ reading

    def _check_consumer(self, consumer: int) -> None:
        if not (isinstance(consumer, int) and 0 <= consumer < self.expected_consumers):
            raise ValueError(
                f"Expect `consumer` in 0..{self.expected_consumers - 1}, got {consumer!r}."
            )

    def delta(self, consumer: int) -> int:
        """How many entries ``consumer`` has not read yet."""
        self._check_consumer(consumer)
        with self._lock:
            return self._base + len(self._entries) - self._positions[consumer]

    def has_anything(self, consumer: int) -> bool:
        """Whether ``consumer`` has unread entries."""
        return self.delta(consumer) > 0

    def drain_to(self, consumer: int, target: torch.Tensor) -> bool:
        """Add every entry ``consumer`` has not read into ``target``; True if there was any.

        Entries are added in arrival order; afterwards those every consumer has read are freed.
        """
        self._check_consumer(consumer)
        codec.check_vector(target, "target")
        with self._lock:
            if self.numel is not None and target.numel() != self.numel:
                raise ValueError(
                    f"Expect `target` of {self.numel} elements (this tail's), got {target.numel()}."
                )
            start = self._positions[consumer] - self._base
            unread = self._entries[start:]
            for entry in unread:
                _add_(target, entry)
            self._positions[consumer] = self._base + len(self._entries)
            self._free_locked()
            return bool(unread)

    # ------------------------------------------------------------------ maintenance

    def updates_size(self) -> int:
        """How many entries are held (unread by at least one consumer)."""
        with self._lock:
            return len(self._entries)

    def maybe_collapse(self) -> bool:
        """Sum the entries no consumer has read into one, if collapsing is on and enough wait.

        Puts already do this, so it only finds work after ``allow_collapse`` was switched on.
        """
        with self._lock:
            return self._collapse_locked()

    def purge(self) -> None:
        """Drop every entry and reset every consumer's position."""
        with self._lock:
            self._entries.clear()
            self._base = 0
            self._positions = [0] * self.expected_consumers
            self._collapsed = None

    def _unread_collapsed_locked(self) -> bool:
        """Whether the last entry is a collapsed one that no consumer has read yet."""
        last = self._base + len(self._entries) - 1
        return self._collapsed == last and max(self._positions) <= last

    def _collapse_locked(self) -> bool:
        if not self.allow_collapse or self.numel is None:
            return False
        first = max(self._positions) - self._base  # entries from here on are read by nobody
        if len(self._entries) - first < COLLAPSE_AT:
            return False
        dense = torch.zeros(self.numel, dtype=torch.float32, device=self._entries[first].device)
        for entry in self._entries[first:]:
            _add_(dense, entry)
        del self._entries[first:]
        self._entries.append(dense)
        self._collapsed = self._base + len(self._entries) - 1
        return True

    def _free_locked(self) -> None:
        done = min(self._positions) - self._base
        if done > 0:
            del self._entries[:done]
            self._base += done


def _add_(target: torch.Tensor, entry: torch.Tensor) -> None:
    """Add one entry (an int32 message or a dense float32 vector) into ``target``."""
    if entry.dtype == torch.int32:
        codec.decode_(entry.to(target.device), target)
    else:
        target.add_(entry.to(device=target.device, dtype=target.dtype))
