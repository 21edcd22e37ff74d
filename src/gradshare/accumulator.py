"""N parties sharing encoded updates: queues, barrier, external source (SPEC §5)."""

from __future__ import annotations

__all__ = ["optimal_buffer_size"]


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
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"Expect `{name}` to be an int >= 1, got {value!r}.")
    return ((num_params // 16) + 65536) * num_workers * queue_size * 4
