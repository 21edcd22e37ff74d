"""One metric naming for every sharing mode, and the warnings for settings that lose."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from gradshare.distributed import metrics
from gradshare.distributed.metrics import share_metrics, warn_if_adaptive
from gradshare.encoding.encoder import EncodeStats

from world import spawn


def test_share_metrics_names_and_ratio() -> None:
    got = share_metrics(100, 400)
    assert got == {
        "bytes_sent": 100.0,
        "dense_bytes": 400.0,
        "compression": 4.0,
        "density": 1.0,
        "threshold": 0.0,
        "stalled": 0.0,
    }


def test_an_encoding_mode_without_stats_reports_unknown_not_dense() -> None:
    """An encoding mode with no encode since it started or loaded a state (the stats are not
    saved) reported density 1 and threshold 0: a resumed run looked dense in its logs."""
    got = share_metrics(100, 400, [None], encoded=True)
    assert math.isnan(got["density"]) and math.isnan(got["threshold"])
    assert got["compression"] == 4.0
    stats = EncodeStats(
        iteration=0,
        threshold=0.5,
        value=0.5,
        format="sparse",
        entries=3,
        density=0.3,
        message_bytes=28,
        dense_bytes=40,
        clipped=0.0,
        residual_norm=1.0,
    )
    got = share_metrics(28, 40, [stats], encoded=True)
    assert (got["density"], got["threshold"]) == (0.3, 0.5)


def _resumed_metrics(rank: int, world: int) -> list[dict[str, float]]:
    """LocalSteps' metrics: before its first sync, after it, and after a resume."""
    from gradshare import LocalSteps

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    with LocalSteps(model, opt, sync_every=1, density=0.05) as sync:
        out.append(sync.metrics())
        model(torch.randn(4, 64, generator=torch.Generator().manual_seed(rank))).sum().backward()
        opt.step()
        out.append(sync.metrics())
        state = sync.state_dict()
    with LocalSteps(model, opt, sync_every=1, density=0.05) as again:
        again.load_state_dict(state)
        out.append(again.metrics())
    return out


def test_local_steps_metrics_before_and_after_a_resume() -> None:
    for r in spawn(_resumed_metrics, 2):
        fresh, synced, resumed = r.get()
        assert math.isnan(fresh["density"]) and math.isnan(resumed["density"])
        assert 0 < synced["density"] < 0.5 and synced["threshold"] > 0
        assert resumed["bytes_sent"] == synced["bytes_sent"] > 0


def test_the_hook_with_adam_warns_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sharing gradients into AdamW loses to sharing its updates: nothing said so."""
    monkeypatch.setattr(metrics, "_warned", set())
    p = [torch.nn.Parameter(torch.zeros(2))]
    with caplog.at_level(logging.WARNING, logger="gradshare.distributed.metrics"):
        assert not warn_if_adaptive(torch.optim.SGD(p, lr=0.1), "the hook")
        assert warn_if_adaptive(torch.optim.AdamW(p), "the hook")
        assert warn_if_adaptive(torch.optim.Adam(p), "the hook")
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "share='updates'" in said[0], said


def test_the_hook_warns_for_adam_subclasses_and_wrapped_adam(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The warning looked at the class name alone: a subclass of AdamW, or an AdamW held by
    a wrapper (accelerate's, Lightning's), went unwarned though ``is_adaptive`` knew them."""
    p = [torch.nn.Parameter(torch.zeros(2))]

    class MyAdamW(torch.optim.AdamW):
        pass

    class Wrapper:
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.optimizer = optimizer

    for optimizer, name in ((MyAdamW(p), "MyAdamW"), (Wrapper(torch.optim.AdamW(p)), "AdamW")):
        monkeypatch.setattr(metrics, "_warned", set())
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="gradshare.distributed.metrics"):
            assert warn_if_adaptive(optimizer, "the hook")
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 1 and f"into {name}," in said[0], said


def _summing(rank: int, world: int) -> list[list[str]]:
    """Build a SharedOptimizer summing by choice, then one summing by default: what each
    logged."""
    from gradshare import SharedOptimizer

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("gradshare.distributed.shared_optimizer").addHandler(handler)
    model = torch.nn.Linear(4, 1)
    out = []
    for encoding in ({"reduction": "sum"}, {}):
        SharedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **encoding)
        out.append(list(said))
        said.clear()
    return out


def test_summing_over_more_than_two_ranks_warns() -> None:
    """SharedOptimizer sums by default: on 3 ranks each step is 3x one rank's, and nothing
    said so. A sum chosen explicitly stays silent."""
    for r in spawn(_summing, 3):
        chosen, default = r.get()
        assert chosen == [], chosen
        assert len(default) == 1 and "Divide the learning rate by 3" in default[0], default
