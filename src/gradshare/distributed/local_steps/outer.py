"""Which outer steps LocalSteps may take itself: plain SGD's, found exactly.

The default outer optimizer, ``torch.optim.SGD`` without momentum, dampening, weight decay,
nesterov or maximize, steps each element by ``param.add_(grad, alpha=-lr)``: an element whose
gradient is +0.0 keeps its value. The mean of sparse messages is +0.0 wherever no message
names the element, so LocalSteps can take that step on the named elements alone
(:func:`gradshare.codec.step_sum_`, the same bits) instead of decoding the mean into every
element and stepping them all. Any other optimizer, or SGD with any of those set, a hook or a
patched ``step``, takes its own step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import optimizer as torch_optimizer

__all__ = ["plain_sgd"]

_PLAIN = {"momentum": 0, "dampening": 0, "weight_decay": 0, "nesterov": False, "maximize": False}
"""The settings of plain SGD: each other value changes the step."""
_DEFAULTED = ("foreach", "fused", "differentiable")
"""Implementation choices that must be left at None or False (the single-tensor step)."""


def plain_sgd(outer: torch.optim.Optimizer) -> dict[int, float] | None:
    """The learning rate of each tensor ``outer`` steps (by ``id``) when it is exactly plain
    ``torch.optim.SGD`` stepping with the single-tensor step, else None.

    Its ``step`` may be wrapped by an LR scheduler (which only notes that it was called:
    :func:`took_step` does the same); any other patch, any step hook, a tensor learning rate
    or weight decay, and any subclass, leave the step to the optimizer.
    """
    if type(outer) is not torch.optim.SGD or not _plain_step_function(outer):
        return None
    if (
        outer._optimizer_step_pre_hooks
        or outer._optimizer_step_post_hooks
        or torch_optimizer._global_optimizer_pre_hooks
        or torch_optimizer._global_optimizer_post_hooks
    ):
        return None
    lrs: dict[int, float] = {}
    for group in outer.param_groups:
        lr = group["lr"]
        if isinstance(lr, torch.Tensor) or any(group.get(k) for k in _DEFAULTED):
            return None
        for key, plain in _PLAIN.items():
            value = group[key]
            if isinstance(value, torch.Tensor) or value != plain:
                return None
        for p in group["params"]:
            lrs[id(p)] = float(lr)
    return lrs


def took_step(outer: torch.optim.Optimizer) -> None:
    """What ``outer.step()`` leaves besides the parameters, for a step LocalSteps took in its
    place: an LR scheduler's wrapper notes the call (``_opt_called``)."""
    if getattr(outer.step, "_wrapped_by_lr_sched", False):
        outer._opt_called = True  # type: ignore[attr-defined]


def _plain_step_function(outer: Any) -> bool:
    """Whether ``outer.step`` is SGD's own, or it wrapped by an LR scheduler alone."""
    step = outer.step
    if getattr(step, "_wrapped_by_lr_sched", False):
        step = getattr(step, "__wrapped__", None)
        return step is torch.optim.SGD.step
    return getattr(step, "__func__", None) is torch.optim.SGD.step
