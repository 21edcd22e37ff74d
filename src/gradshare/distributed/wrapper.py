"""The optimizer-API glue of a wrapper around another optimizer (``SharedOptimizer``).

A wrapper is a ``torch.optim.Optimizer`` (so LR schedulers, ``GradScaler``, step hooks and the
profiler accept it) whose parameters, settings and state are the wrapped optimizer's. They are
read through on every access, never copied: torch's ``Optimizer.load_state_dict`` puts a new
``param_groups`` list on the wrapped optimizer, and a copy kept here would go stale, so that an
LR scheduler built on the wrapper would write learning rates no step reads.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

__all__ = ["OptimizerWrapper"]


class OptimizerWrapper(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose ``param_groups``, ``defaults`` and ``state`` are those
    of ``self.optim``, always the current ones. Subclasses implement :meth:`step`."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"Expect `optimizer` to be a torch.optim.Optimizer, got {type(optimizer).__name__}."
            )
        self.optim = optimizer
        self._init_hooks()

    def _init_hooks(self) -> None:
        """What ``torch.optim.Optimizer.__init__`` sets besides the parameters and the state
        (which are the wrapped optimizer's): the hook registries and the patched ``step``, so
        that ``register_step_pre_hook`` / ``register_step_post_hook`` (run once per step),
        the state-dict hooks and the profiler work on this wrapper as on any optimizer."""
        for name in (
            "_optimizer_step_pre_hooks",
            "_optimizer_step_post_hooks",
            "_optimizer_state_dict_pre_hooks",
            "_optimizer_state_dict_post_hooks",
            "_optimizer_load_state_dict_pre_hooks",
            "_optimizer_load_state_dict_post_hooks",
        ):
            setattr(self, name, OrderedDict())
        self._patch_step_function()

    # ------------------------------------------------------------------ read through

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups (the list it holds now)."""
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optim.param_groups = groups

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optim.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.optim.defaults = defaults

    @property
    def state(self) -> Any:
        return self.optim.state

    @state.setter
    def state(self, state: Any) -> None:
        self.optim.state = state

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)
