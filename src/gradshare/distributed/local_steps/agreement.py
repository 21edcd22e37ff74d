"""An outer optimizer for many ranks under an adaptive inner optimizer: the mean mapped by how
much the ranks agree.

Dense DDP on M ranks gives Adam (and its kin) the mean of M gradients: an element where the
ranks' gradients disagree has a small mean, but also a second moment whose noise is 1/M of one
rank's, so Adam still moves it by a fair share of its lr. LocalSteps averages M ranks' own
Adam steps instead, each normalised by one rank's noise, so such an element moves up to
sqrt(M) times less than under DDP, while one that all ranks agree on moves alike; the loss
over dense DDP grows with M (docs/benchmarks.md, "More ranks, and a schedule").

:class:`AgreementSGD` maps each element of the mean outer gradient by that ratio before plain
SGD's step. Per tensor, with ``top`` = max |mean| (where the ranks agree) and ``a = mean / top``
in [-1, 1]:

    step = -lr · top · a / sqrt(a² + (1 - a²) / M)

that is, Adam's normalised step on the mean of M gradients, ``μ / sqrt(μ² + σ²/M)``, written in
terms of the mean of M ranks' normalised steps, ``a = μ / sqrt(μ² + σ²)``. An element all ranks
agree on (a = ±1) keeps its value, one that one rank alone sends (a = 1/M) grows by about
sqrt(M), and with one rank the step is plain SGD's (up to rounding).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["AgreementSGD", "agreement_step"]


class AgreementSGD(torch.optim.Optimizer):
    """Plain SGD on the mean outer gradient mapped by the ranks' agreement (module docstring).

    An option to try with an adaptive inner optimizer on 4 or more ranks, at a lower lr than
    plain SGD's default: ``LocalSteps(model, opt, outer_optimizer=lambda p: AgreementSGD(p,
    lr=2.0))``, and compare with a dense run. It is not the default: at 8 ranks it helped one
    GPT and not the other (docs/benchmarks.md, "More ranks, and a schedule").

    Args:
        params: the global copy's tensors (what ``outer_optimizer`` is given).
        lr: the learning rate (> 0, finite).
        ranks: M, how many ranks' pseudo-gradients the mean averages (>= 1); None: the
            default process group's world size when this is built.
    """

    def __init__(self, params: Iterable[Any], lr: float, ranks: int | None = None) -> None:
        if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
            raise ValueError(f"Expect `lr` > 0 and finite, got {lr!r}.")
        if ranks is None:
            if not dist.is_initialized():
                raise ValueError(
                    "AgreementSGD(ranks=None) takes the world size of the default process "
                    "group, which is not initialised: call init_process_group first or pass "
                    "`ranks`."
                )
            ranks = dist.get_world_size()
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
            raise ValueError(f"Expect `ranks` an int >= 1, got {ranks!r}.")
        super().__init__(params, {"lr": float(lr), "ranks": ranks})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(agreement_step(p.grad, group["ranks"]), alpha=-group["lr"])
        return loss


def agreement_step(mean: torch.Tensor, ranks: int) -> torch.Tensor:
    """``mean`` mapped by the agreement of ``ranks`` ranks: ``top · a / sqrt(a² + (1 - a²) /
    ranks)`` with ``top`` = max |mean| and ``a = mean / top``; zeros stay zeros, and a mean
    with nothing to map (all zeros, or not finite) is returned as it is."""
    top = mean.abs().max() if mean.numel() else mean.new_zeros(())
    if not top > 0 or not torch.isfinite(top):
        return mean.clone()
    a = mean / top
    return a / torch.sqrt(a * a + (1 - a * a) / ranks) * top
