"""Mixed precision's skipped steps: ``torch.amp.GradScaler`` skips the optimizer step on a rank
whose gradients overflowed. With rank-local gradients (``SharedOptimizer``, with or without
``ddp=``) the other ranks step; every rank must still take part in the same exchanges, so the
wrapper takes the step itself, skips only the local update, and joins the exchange."""

from __future__ import annotations

import torch
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from gradshare import SharedOptimizer

from toys import flat, toy_batches, toy_model
from world import spawn

STEPS, OVERFLOW = 6, 2
"""Steps each rank takes; the step at which rank 1's gradients overflow."""


def _scaled(rank: int, world: int, with_ddp: bool) -> dict:
    model = toy_model()
    net = DDP(model) if with_ddp else model
    opt = SharedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        timeout=10,
        **({"ddp": net} if with_ddp else {}),
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    exchanges = 0
    for step, (x, y) in enumerate(toy_batches(STEPS * world)[rank::world]):
        opt.zero_grad()
        scaler.scale(F.cross_entropy(net(x), y)).backward()
        if rank == 1 and step == OVERFLOW:
            next(model.parameters()).grad.view(-1)[0] = float("inf")  # type: ignore[union-attr]
        before = opt.iteration
        scaler.step(opt)
        scaler.update()
        exchanges += opt.iteration - before
    return {"params": flat(model), "exchanges": exchanges, "scale": scaler.get_scale()}


def _rank_scaled(rank: int, world: int) -> dict:
    return {name: _scaled(rank, world, with_ddp) for name, with_ddp in VARIANTS.items()}


VARIANTS = {"alone": False, "ddp": True}


def test_a_step_skipped_on_one_rank_still_exchanges_everywhere() -> None:
    """Both paths in one world: ``SharedOptimizer(opt)`` and ``SharedOptimizer(opt, ddp=)``."""
    results = [r.get() for r in spawn(_rank_scaled, 2, timeout=120)]
    for name in VARIANTS:
        ranks = [r[name] for r in results]
        assert [r["exchanges"] for r in ranks] == [STEPS, STEPS], name
        assert torch.equal(ranks[0]["params"], ranks[1]["params"]), name
        assert ranks[1]["scale"] < ranks[0]["scale"], name  # rank 1's scaler saw the overflow
