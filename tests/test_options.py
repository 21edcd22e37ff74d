"""The encoding options are declared once (``EncodingOptions``) and every front end takes the
same keywords: each field reaches the front end's encoders, a bad value is refused alike, an
unknown keyword is named."""

from __future__ import annotations

import ast
import dataclasses
import itertools
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradshare.encoding.options as options_module
from gradshare import (
    EncodedGradientsAccumulator,
    EncodingOptions,
    FixedThreshold,
    LocalSteps,
    LocalStepsOptions,
    ParallelWrapper,
    ResidualClipping,
    SharedOptimizer,
    ThresholdHookState,
    register_threshold_hook,
)
from gradshare.encoding.options import FIELDS

from world import spawn

SET = {
    "threshold": FixedThreshold(0.25),
    "post_processor": ResidualClipping(3, 2),
    "boundary": 7,
    "magnitude": "mean",
    "reduction": "sum",
    "timeout": timedelta(seconds=42),
}
"""A value other than the default for every field but ``dense`` (checked on its own)."""


def test_the_fields_are_the_documented_ones() -> None:
    assert FIELDS == (
        "threshold",
        "post_processor",
        "boundary",
        "magnitude",
        "dense",
        "reduction",
        "timeout",
    )
    assert set(SET) | {"dense"} == set(FIELDS)


def test_every_field_has_a_docstring() -> None:
    """torchtitan's manner: a string right under each field says what it is."""
    source = Path(options_module.__file__).read_text()
    body = next(
        n
        for n in ast.parse(source).body
        if isinstance(n, ast.ClassDef) and n.name == "EncodingOptions"
    ).body
    documented = {
        a.target.id
        for a, b in itertools.pairwise(body)
        if isinstance(a, ast.AnnAssign)
        and isinstance(a.target, ast.Name)
        and isinstance(b, ast.Expr)
        and isinstance(b.value, ast.Constant)
    }
    assert documented == {f.name for f in dataclasses.fields(EncodingOptions)}


@pytest.mark.parametrize(
    ("field", "bad", "error"),
    [
        ("threshold", 0.5, TypeError),
        ("post_processor", "clip", TypeError),
        ("boundary", 0, ValueError),
        ("magnitude", "max", ValueError),
        ("dense", 1, TypeError),
        ("reduction", "avg", ValueError),
        ("timeout", -1, ValueError),
    ],
)
def test_a_bad_value_is_refused_naming_its_field(field: str, bad: Any, error: type) -> None:
    with pytest.raises(error, match=f"`{field}`"):
        EncodingOptions(**{field: bad})


def test_dense_refuses_a_threshold() -> None:
    with pytest.raises(ValueError, match="`threshold` with `dense=True`"):
        EncodingOptions(dense=True, threshold=FixedThreshold(1.0))


def _check_encoder(enc: Any) -> None:
    assert enc.algorithm is not SET["threshold"] and repr(enc.algorithm) == repr(SET["threshold"])
    assert enc.post_processor is not SET["post_processor"]
    assert repr(enc.post_processor) == repr(SET["post_processor"])
    assert enc.boundary == 7 and enc.magnitude == "mean"


def test_the_local_front_ends_take_every_field() -> None:
    acc = EncodedGradientsAccumulator(2, **SET)
    assert acc.options == EncodingOptions(**SET)
    assert acc.reduction == "sum" and acc.timeout == 42
    assert acc.encoders is not None
    for enc in acc.encoders:
        _check_encoder(enc)
    assert acc.encoders[0].algorithm is not acc.encoders[1].algorithm  # each party its own
    wrapper = ParallelWrapper(torch.nn.Linear(2, 1), torch.optim.SGD, torch.nn.MSELoss(), **SET)
    assert wrapper.accumulator.options == acc.options
    assert EncodedGradientsAccumulator(2, dense=True).encoders is None
    with pytest.raises(TypeError, match=r"unexpected keyword\(s\) \['thresold'\]"):
        EncodedGradientsAccumulator(2, thresold=FixedThreshold(1.0))
    with pytest.raises(TypeError, match="in one place"):
        EncodedGradientsAccumulator(2, options=EncodingOptions(), boundary=3)


def _rank_front_ends(rank: int, world: int) -> dict[str, str]:
    """Every distributed front end built with every field (and the hook state through both
    spellings); returns what each kept."""
    out = {}
    model = torch.nn.Linear(3, 2)
    shared = SharedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **SET)
    assert shared.encoder is not None
    _check_encoder(shared.encoder)
    assert shared.reduction == "sum" and shared.timeout == SET["timeout"]
    out["shared"] = repr(shared.options)
    state = ThresholdHookState(**SET)
    assert state.options == EncodingOptions(**SET) and state.timeout == SET["timeout"]
    encoders = state.parameters.for_params([((0, 0), 4)], torch.device("cpu"))
    _check_encoder(encoders[0])
    assert state.divisor(world) == 1  # "sum"
    assert ThresholdHookState().divisor(world) == world  # the hook's default: DDP's mean
    ddp = DDP(torch.nn.Linear(3, 2))
    hooked = register_threshold_hook(ddp, options=EncodingOptions(**SET), momentum=0.5)
    assert hooked.options == state.options and hooked.momentum == 0.5
    local_model = torch.nn.Linear(3, 2)
    inner = torch.optim.SGD(local_model.parameters(), lr=0.1)
    with LocalSteps(local_model, inner, 2, **SET) as sync:
        for enc in sync.encoders:
            _check_encoder(enc)
        assert sync.timeout == SET["timeout"] and sync._protocol.divisor == 1
        out["local"] = repr(sync.options)
    fields = {**LOCAL, "offload": False, "fragments": 2}  # a CPU model of 2 tensors
    with LocalSteps(local_model, inner, **fields) as sync:  # every LocalStepsOptions field
        assert sync.local == LocalStepsOptions(**fields)
        assert (sync.sync_every, sync.overlap, sync.fragments, sync.compact) == (6, 2, 2, False)
        assert isinstance(sync.outer, torch.optim.SGD) and sync.outer.param_groups[0]["lr"] == 1
    with LocalSteps(local_model, inner, local=LocalStepsOptions(**fields)) as sync:
        assert sync.local.decay == 0.9
    dense = SharedOptimizer(torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1), dense=True)
    assert dense.encoder is None
    # the default reductions: DL4J's sum alone, DDP's mean with ddp=
    assert SharedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1)).reduction == "sum"
    ddp2 = DDP(torch.nn.Linear(3, 2))
    opt2 = torch.optim.SGD(ddp2.parameters(), lr=0.1)
    assert SharedOptimizer(opt2, ddp=ddp2).reduction == "mean"
    dist.barrier()
    return out


def test_the_distributed_front_ends_take_every_field() -> None:
    results = [r.get() for r in spawn(_rank_front_ends, 2)]
    assert results[0] == results[1]


def test_the_lightning_strategy_takes_every_field() -> None:
    """Lightning's own ``timeout`` is DDPStrategy's, so gradshare's is ``gradshare_timeout``."""
    pytest.importorskip("lightning")
    from gradshare.integrations import GradshareDDPStrategy

    fields = {k: v for k, v in SET.items() if k != "timeout"}
    strategy = GradshareDDPStrategy(gradshare_timeout=SET["timeout"], momentum=0.5, **fields)
    assert strategy.options == EncodingOptions(**SET)
    assert GradshareDDPStrategy(dense=True).options.dense
    with pytest.raises(ValueError, match="`magnitude`"):
        GradshareDDPStrategy(magnitude="max")


# ---------------------------------------------------------------------- LocalStepsOptions

OUTER = lambda p: torch.optim.SGD(p, lr=1.0)
LOCAL = {
    "sync_every": 6,
    "density": 0.02,
    "decay": 0.9,
    "outer_optimizer": OUTER,
    "offload": True,
    "overlap": 2,
    "fragments": 3,
    "compact": False,
    "broadcast_buffers": False,
}
"""A value other than the default for every field of LocalStepsOptions."""


def test_the_local_steps_fields_are_the_documented_ones() -> None:
    """One declaration: ``sync_every`` was required in LocalSteps and 10 in the integrations,
    ``compact`` off everywhere; every field has a docstring under it."""
    from gradshare import LocalStepsOptions
    from gradshare.distributed.local_steps import options as local_module
    from gradshare.distributed.local_steps.options import FIELDS as LOCAL_FIELDS

    assert set(LOCAL) == set(LOCAL_FIELDS)
    defaults = LocalStepsOptions()
    got = (defaults.sync_every, defaults.density, defaults.decay, defaults.compact)
    assert got == (10, 0.04, 0.95, True)
    source = Path(local_module.__file__).read_text()
    classes = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)]
    body = next(n for n in classes if n.name == "LocalStepsOptions").body
    documented = {
        a.target.id
        for a, b in itertools.pairwise(body)
        if isinstance(a, ast.AnnAssign)
        and isinstance(a.target, ast.Name)
        and isinstance(b, ast.Expr)
        and isinstance(b.value, ast.Constant)
    }
    assert documented == set(LOCAL_FIELDS)


@pytest.mark.parametrize(
    ("field", "bad", "error"),
    [
        ("sync_every", 0, ValueError),
        ("density", 1.5, ValueError),
        ("decay", -0.1, ValueError),
        ("outer_optimizer", 1.0, TypeError),
        ("offload", 1, TypeError),
        ("overlap", "yes", TypeError),
        ("fragments", 20, ValueError),
        ("compact", "no", TypeError),
        ("broadcast_buffers", None, TypeError),
    ],
)
def test_a_bad_local_steps_value_is_refused_naming_its_field(
    field: str, bad: Any, error: type
) -> None:
    from gradshare import LocalStepsOptions

    with pytest.raises(error, match=f"`{field}`"):
        LocalStepsOptions(**{field: bad})


def test_the_integrations_take_every_local_steps_field() -> None:
    """The Lightning strategy and the Trainer callback declared the LocalSteps knobs again,
    and drifted (no ``offload``, ``compact`` off, ``sync_every`` 10 where LocalSteps had
    none); both now take the dataclass or its fields, validated there."""
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    from gradshare import LocalStepsOptions
    from gradshare.integrations import GradshareCallback, GradshareDDPStrategy

    want = LocalStepsOptions(**LOCAL)
    strategy = GradshareDDPStrategy(share="local", **LOCAL)
    callback = GradshareCallback(share="local", **LOCAL)
    assert strategy.local == want == callback.local
    assert GradshareDDPStrategy(local=want).local is want
    assert GradshareCallback(local=want).local is want
    for front in (GradshareDDPStrategy, GradshareCallback):
        with pytest.raises(ValueError, match="`density`"):
            front(share="local", density=0.5 + 1)
        with pytest.raises(TypeError, match="in one place"):
            front(local=want, decay=0.5)
    with pytest.warns(DeprecationWarning, match="'gradients' in every integration"):
        assert GradshareCallback(share="hook").share == "gradients"
    with pytest.warns(DeprecationWarning):
        assert GradshareDDPStrategy(share="hook").share == "gradients"
    with pytest.raises(ValueError, match="`share`"):
        GradshareCallback(share="grads")  # type: ignore[arg-type]


def test_gradshare_train_takes_the_local_steps_fields() -> None:
    """``gradshare train`` validates its local-steps options as LocalStepsOptions does."""
    from gradshare.app.train import TrainConfig

    config = TrainConfig(
        local_steps=6, density=0.02, decay=0.9, overlap=2, fragments=3, compact=False
    )
    local = config.local_options()
    got = (local.sync_every, local.density, local.decay, local.overlap, local.fragments)
    assert (*got, local.compact) == (6, 0.02, 0.9, 2, 3, False)
    with pytest.raises(ValueError, match="--overlap: Expect `overlap`"):
        TrainConfig(local_steps=2, overlap=3)
    with pytest.raises(ValueError, match="--density: Expect `density` under 1/16"):
        TrainConfig(density=0.1)
