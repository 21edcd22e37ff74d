"""AgreementSGD (:mod:`gradshare.distributed.local_steps.agreement`): the mean outer gradient
mapped by the ranks' agreement, against its formula in float64, and as LocalSteps' outer
optimizer on two ranks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from gradshare import AgreementSGD, LocalSteps
from gradshare.distributed.local_steps.agreement import agreement_step

from toys import toy_batches, toy_model
from world import pooled


def _reference(mean: list[float], ranks: int) -> list[float]:
    top = max(abs(m) for m in mean)
    out = []
    for m in mean:
        a = m / top
        out.append(top * a / math.sqrt(a * a + (1 - a * a) / ranks))
    return out


class TestTheMap:
    def test_agreement_keeps_the_mean_and_one_rank_grows_by_up_to_sqrt_m(self) -> None:
        mean = [0.5, 0.25, -0.125, 0.0, -0.5]  # all agree, half, one of 4 (negative), none
        got = agreement_step(torch.tensor(mean), 4)
        torch.testing.assert_close(got, torch.tensor(_reference(mean, 4)))
        assert got[0] == 0.5 and got[4] == -0.5 and got[3] == 0.0  # a = ±1 and 0 stay
        assert got[2] / -0.125 == pytest.approx(1 / math.sqrt(1 / 16 + 15 / 64))  # 2.18x

    def test_one_rank_is_plain_sgd_and_zeros_stay_zeros(self) -> None:
        mean = torch.tensor([0.3, -0.1, 0.05, 0.0])
        torch.testing.assert_close(agreement_step(mean, 1), mean)
        assert torch.equal(agreement_step(torch.zeros(3), 8), torch.zeros(3))

    def test_the_step_is_plain_sgd_on_the_mapped_mean(self) -> None:
        p = torch.tensor([1.0, 2.0, 3.0])
        opt = AgreementSGD([p], lr=2.0, ranks=8)
        p.grad = torch.tensor([0.4, -0.05, 0.0])
        before = p.clone()
        opt.step()
        mapped = agreement_step(torch.tensor([0.4, -0.05, 0.0]), 8)
        assert torch.equal(p, torch.add(before, mapped, alpha=-2.0))
        assert opt.state_dict()["param_groups"][0]["ranks"] == 8

    @pytest.mark.parametrize(
        ("kwargs", "error"),
        [
            ({"lr": 0.0, "ranks": 2}, "Expect `lr` > 0"),
            ({"lr": float("nan"), "ranks": 2}, "Expect `lr` > 0"),
            ({"lr": 1.0, "ranks": 0}, "Expect `ranks` an int >= 1"),
            ({"lr": 1.0, "ranks": True}, "Expect `ranks` an int >= 1"),
            ({"lr": 1.0}, "call init_process_group first or pass `ranks`"),
        ],
    )
    def test_bad_settings_name_the_fix(self, kwargs: dict, error: str) -> None:
        with pytest.raises(ValueError, match=error):
            AgreementSGD([torch.zeros(2)], **kwargs)


def _rank_agreement(rank: int, world: int) -> dict:
    model = toy_model(seed=0)
    inner = torch.optim.AdamW(model.parameters(), lr=0.05)
    steps: list[tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]] = []

    def outer(params: list[torch.Tensor]) -> AgreementSGD:
        opt = AgreementSGD(params, lr=2.8)
        real = opt.step

        def recorded() -> None:
            before = [p.detach().clone() for p in params]
            grads = [p.grad.clone() for p in params if p.grad is not None]
            real()
            steps.append((before, grads, [p.detach().clone() for p in params]))

        opt.step = recorded  # type: ignore[method-assign]
        return opt

    sync = LocalSteps(model, inner, sync_every=2, outer_optimizer=outer)
    batches = toy_batches(4, seed=10 + rank)
    for x, y in batches:
        inner.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        inner.step()
    sync.close()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(every, flat)
    return {"steps": steps, "identical": all(torch.equal(every[0], f) for f in every)}


def test_local_steps_steps_the_global_copy_by_the_mapped_mean() -> None:
    """Two ranks, AdamW, two syncs: each outer step is the formula's on the decoded mean, the
    map changed it (the ranks disagree somewhere) and the replicas end bit-identical."""
    runs = [r.get() for r in pooled(_rank_agreement, 2)]
    for run in runs:
        assert run["identical"] and len(run["steps"]) == 2
        for before, grads, after in run["steps"]:
            assert len(grads) == len(before)
            for b, g, a in zip(before, grads, after, strict=True):
                assert torch.equal(a, torch.add(b, agreement_step(g, 2), alpha=-2.8))
            mapped = zip(before, grads, after, strict=True)
            assert any(not torch.equal(a, torch.add(b, g, alpha=-2.8)) for b, g, a in mapped)
    for x, y in zip(runs[0]["steps"], runs[1]["steps"], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(x[2], y[2], strict=True))
