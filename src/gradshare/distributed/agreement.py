"""One check that every rank runs with the same settings, and one error when they do not.

Ranks whose settings differ either drift apart silently (one sums, another averages) or issue
different collectives (one all-reduces, another all-gathers), which gloo answers with an abort
or every rank with a wait until the timeout. :func:`agree` turns that into one readable error,
the same on every rank, before anything is exchanged:

1. every rank all-gathers a fixed-size int64 row: the count of its settings, then for each the
   crc32 of its name and of the ``repr`` of its value, padded to :data:`WIDTH` settings, so
   that ranks with different lists of settings still issue the same collective;
2. every rank sees the same table, so all of them find the same differing settings (or none,
   and return);
3. if any differ, every rank all-gathers the readable text of those settings (the lengths
   first, then the bytes padded to the longest) and raises the same ``ValueError``, naming each
   differing setting and each rank's (global) value: "`reduction` 'sum' on rank 0, 'mean' on
   rank 1".

Only int64 rows and bytes travel; nothing is pickled.
"""

from __future__ import annotations

import json
import zlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradshare.distributed.exchange import collective, global_ranks

__all__ = ["WIDTH", "agree"]

WIDTH = 32
"""The most settings one check compares (the row is padded to this many)."""


def _crc(text: str) -> int:
    return zlib.crc32(text.encode())


def agree(
    settings: dict[str, Any],
    *,
    group: dist.ProcessGroup | None,
    timeout: timedelta,
    what: str,
    device: torch.device | None = None,
) -> None:
    """Raise the same ``ValueError`` on every rank of ``group`` unless every rank passes
    equal ``settings`` (compared by the ``repr`` of each value); a collective of every rank.

    ``what`` names the caller in the error ("SharedOptimizer", "the DDP hook", ...).
    """
    if len(settings) > WIDTH:
        raise ValueError(f"Expect at most {WIDTH} settings to compare, got {len(settings)}.")
    device = torch.device("cpu") if device is None else device
    texts = {name: repr(value) for name, value in settings.items()}
    row = torch.zeros(1 + 2 * WIDTH, dtype=torch.int64)
    row[0] = len(texts)
    for i, (name, text) in enumerate(texts.items()):
        row[1 + 2 * i], row[2 + 2 * i] = _crc(name), _crc(text)
    table = _gather(row.to(device), group, timeout, f"settings check ({what})")
    books = [{r[1 + 2 * i]: r[2 + 2 * i] for i in range(r[0])} for r in table]
    order = list(dict.fromkeys(k for r in table for k in (r[1 + 2 * i] for i in range(r[0]))))
    differ = [k for k in order if len({b.get(k) for b in books}) > 1]
    if not differ:
        return
    mine = {name: text for name, text in texts.items() if _crc(name) in set(differ)}
    seen = _gather_texts(json.dumps(mine), group, timeout, device, what)
    named = {_crc(name): name for texts_of_rank in seen for name in texts_of_rank}
    ranks = global_ranks(group)
    parts = []
    for k in differ:
        values = ", ".join(
            f"{texts_of_rank.get(named[k], '(not set)')} on rank {ranks[r]}"
            for r, texts_of_rank in enumerate(seen)
        )
        parts.append(f"`{named[k]}` {values}")
    raise ValueError(
        f"{what}: the ranks' settings differ: {'; '.join(parts)}. Build it with the same "
        "settings on every rank (different settings would make the replicas drift apart "
        "silently, or the ranks issue different collectives)."
    )


def _gather(
    row: torch.Tensor, group: dist.ProcessGroup | None, timeout: timedelta, what: str
) -> list[list[int]]:
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size(group))]
    collective(
        dist.all_gather, rows, row, group=group, timeout=timeout, what=what, rank=dist.get_rank()
    )
    return torch.stack(rows).cpu().tolist()


def _gather_texts(
    text: str, group: dist.ProcessGroup | None, timeout: timedelta, device: torch.device, what: str
) -> list[dict[str, str]]:
    """Every rank's ``text`` (a JSON object), lengths first, then the bytes padded."""
    data = text.encode()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = _gather(size, group, timeout, f"settings text sizes ({what})")
    longest = max(n for (n,) in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    padded = padded.to(device)
    out = [torch.empty_like(padded) for _ in lengths]
    collective(
        dist.all_gather,
        out,
        padded,
        group=group,
        timeout=timeout,
        what=f"settings text ({what})",
        rank=dist.get_rank(),
    )
    texts = []
    for (n,), t in zip(lengths, out, strict=True):
        try:
            texts.append(json.loads(bytes(t.cpu()[:n].tolist()).decode()))
        except ValueError:
            texts.append({})
    return texts
