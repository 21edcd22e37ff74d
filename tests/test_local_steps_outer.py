"""Which outer steps LocalSteps takes itself (:mod:`gradshare.distributed.local_steps.outer`):
plain SGD found exactly, and nothing else. That its step gives SGD's own bits is in
tests/test_codec.py (``step_sum_``) and tests/test_local_steps.py (three ranks)."""

from __future__ import annotations

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from gradshare.distributed.local_steps.outer import plain_sgd, took_step


def _sgd(**settings: object) -> torch.optim.SGD:
    return torch.optim.SGD([torch.zeros(3, requires_grad=True)], lr=2.8, **settings)  # type: ignore[arg-type]


class TestPlainSGD:
    """Only ``torch.optim.SGD`` whose step is ``param.add_(grad, alpha=-lr)`` qualifies: any
    setting, hook, patch or subclass that changes or watches the step leaves it to torch."""

    def test_plain_sgd_and_its_groups(self) -> None:
        a, b = torch.zeros(2), torch.zeros(3)
        opt = torch.optim.SGD([{"params": [a]}, {"params": [b], "lr": 0.5}], lr=2.8)
        assert plain_sgd(opt) == {id(a): 2.8, id(b): 0.5}
        assert plain_sgd(_sgd(foreach=False)) is not None

    @pytest.mark.parametrize(
        "settings",
        [
            {"momentum": 0.9},
            {"weight_decay": 1e-4},
            {"momentum": 0.9, "nesterov": True},
            {"maximize": True},
            {"dampening": 0.1},
            {"foreach": True},
            {"weight_decay": torch.tensor(0.0)},
        ],
    )
    def test_any_other_setting_takes_its_own_step(self, settings: dict) -> None:
        assert plain_sgd(_sgd(**settings)) is None

    def test_hooks_patches_subclasses_and_tensor_lr(self) -> None:
        hooked = _sgd()
        hooked.register_step_post_hook(lambda *_: None)
        assert plain_sgd(hooked) is None
        patched = _sgd()
        patched.step = lambda closure=None: None  # type: ignore[method-assign]
        assert plain_sgd(patched) is None

        class Mine(torch.optim.SGD):
            pass

        assert plain_sgd(Mine([torch.zeros(1)], lr=1.0)) is None
        assert plain_sgd(torch.optim.SGD([torch.zeros(1)], lr=torch.tensor(1.0))) is None
        handle = register_optimizer_step_pre_hook(lambda *_: None)
        try:
            assert plain_sgd(_sgd()) is None
        finally:
            handle.remove()
        assert plain_sgd(_sgd()) is not None

    def test_an_lr_scheduler_is_told_of_the_step(self) -> None:
        """A scheduler wraps ``step`` to note that it ran (it warns when it steps before the
        optimizer did): the step LocalSteps takes notes it the same way."""
        opt = _sgd()
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        assert plain_sgd(opt) is not None
        opt._opt_called = False  # type: ignore[attr-defined]
        took_step(opt)
        assert opt._opt_called  # type: ignore[attr-defined]
        scheduler.step()
        assert plain_sgd(opt) == {id(opt.param_groups[0]["params"][0]): 1.4}
