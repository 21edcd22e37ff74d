"""Local steps (DiLoCo / SparseLoCo) against every-step exchanges: quality per byte.

Run (PYTHONPATH=src, or an installed checkout; ``OMP_NUM_THREADS=1`` is set for the ranks):

  python bench/local_steps.py --workload gpt --steps 1000 --seeds 0 1 \\
      --methods dense local-H10 diloco-dense shared-ddp postlocal \\
      --out bench/results/local_steps_gpt1000.json
  python bench/local_steps.py --workload gpt --steps 1000 --seeds 0 1 \\
      --methods local-H10-d4-lr1.0 local-H10-d4-lr1.2 local-H10-d4-lr1.6 local-H10-d2 \\
      --out bench/results/local_steps_gpt1000.json          (appends to the same file)
  python bench/local_steps.py --workload gpt --steps 300 --seeds 0 1 --methods dense local-H10 \\
      --out bench/results/local_steps_gpt300.json
  python bench/local_steps.py --workload gpt --world 4 --steps 1000 --seeds 0 \\
      --methods dense local-H10 --out bench/results/local_steps_gpt1000_w4.json
  python bench/local_steps.py --workload gpt --world 8 --steps 600 --seeds 0 1 2 \\
      --methods dense local-H10 local-H10-lr4.0 --out bench/results/local_steps_w8.json
  python bench/local_steps.py --workload gpt-cosine --steps 300 --seeds 0 1 2 \\
      --methods dense local-H10 diloco-dense --out bench/results/local_steps_cosine300.json
  python bench/local_steps.py --workload cnn --seeds 0 1 --methods dense local-H10 \\
      --out bench/results/local_steps_cnn.json
  python bench/local_steps.py --workload gpt2 --world 2|4|8 --steps 600 --seeds 0 \\
      --methods dense local-H10 local-H10-lr4.0 --out bench/results/local_steps_gpt2.json
  python bench/local_steps.py --workload gpt --world 2|4|8 --steps 600 --seeds 0 \\
      --methods dense local-H10-d1 local-H10-d2 local-H10 local-H10-d6 diloco-dense \\
      --out bench/results/local_steps_curve.json
  python bench/local_steps.py --report bench/results/local_steps_gpt1000.json   (table + plot)

The workloads are ``bench/workloads.py``'s (imported, not copied): ``gpt`` (0.43M char-level
GPT, AdamW, ``clip_grad_norm_(1.0)``, pydoc text; metric validation loss), ``gpt-cosine`` (the
same with a warm-up over 10 % of the steps and a cosine to 10 % of the lr, :data:`SCHEDULED`),
``gpt2`` (a GPT no one here wrote: Hugging Face's ``GPT2LMHeadModel``, 3 layers of width 128,
its own init and tied embeddings, with the AdamW of Trainer's defaults at lr 1e-3, on the same
text and batches, :data:`OTHERS`) and ``cnn`` (MNIST-5k, momentum SGD; metric test accuracy in
points). ``--world`` gloo ranks on 127.0.0.1 (``mp.spawn``); every method starts from the
seed's weights and rank r draws the batches of generator ``1000 * seed + r``, so every method
sees the same batches.

Methods:

* ``dense``: DDP, the baseline (4 bytes per element per step).
* ``local-H{h}``: ``LocalSteps(model, opt, sync_every=h)`` with every default (what users
  call); ``local-H{h}-d{pct}`` sets ``density=pct/100``; suffixes ``-lr{x}`` (outer SGD lr),
  ``-b{x}`` (decay β) override one more default each, ``-w{n}`` passes
  ``threshold=QuantileThreshold(density, warmup=n)`` (the density starts at 25% and falls to
  ``density`` over the first n syncs), ``-mean`` sets ``magnitude="mean"``
  (each sent entry carries the mean magnitude of what its tensor sends, not the threshold),
  ``-nesterov`` makes the outer SGD DiLoCo's Nesterov momentum 0.9 (lr 0.7 unless ``-lr``),
  ``-m{x}`` gives it heavy-ball momentum x instead (the default lr unless ``-lr``).
* ``diloco-dense`` / ``diloco-dense-H{h}``: ``LocalSteps(dense=True)`` with DiLoCo's outer
  optimizer, Nesterov SGD lr 0.7 momentum 0.9 (H 10 unless given).
* ``postlocal`` / ``postlocal-H{h}``: torch's ``PostLocalSGDOptimizer`` with a
  ``PeriodicModelAverager(period=h, warmup_steps=0)`` on the plain (not DDP) model: every
  ``h`` steps the parameters are all-reduced and averaged (dense model averaging; 4 bytes per
  element per average; no DDP comm hook, whose intra-node subgroup would all-reduce every step
  on one host).
* ``torchft`` / ``torchft-H{h}``: torchft's ``DiLoCo`` (0.2.0, bench-only: ``pip install -c
  constraints.txt torchft==0.2.0``) as published: a ``LighthouseServer`` in the parent, per
  rank a replica group of one (its own TCPStore, ``Manager(ProcessGroupGloo(),
  use_async_quorum=False, init_sync=False)``), outer Nesterov SGD 0.7 / 0.9, dense float32.
* ``-agree``: the outer optimizer is ``gradshare.AgreementSGD`` (plain SGD on the mean mapped
  by the ranks' agreement), at the default lr unless ``-lr``; ``-agree{m}`` maps as for m
  ranks (``ranks=m``: m below the world size maps milder).
* ``-snr`` (a study, after ``-agree``): before each sync, each rank scales its Δ per element
  by sqrt(v / (μ² + σ²/M)), μ² and σ² estimated from its own Adam moments (an adaptive inner
  optimizer only): as Adam's step on M ranks' mean gradient is against one rank's.
* ``-share`` (a study, after ``-snr``): before each sync the model's entries (density x its
  elements) are parted among the tensors by their share of the update, one threshold over the
  whole model's β·residual + Δ setting each tensor's density (in [density/8, 50 %]; a bitmap
  past 1/16); ``-share{pct}`` caps each at pct % and parts what a cap leaves among the others;
  ``-floor`` after it gives each tensor at least the density.
* ``-warm{n}`` (a study, after ``-share``, before ``-f``): the first n inner steps each end
  with a sync, then every H (more syncs while the replicas part fastest; more bytes).
* ``-overlap`` (after any ``local`` method): ``overlap=True``, merged at the next sync;
  ``-overlap{τ}``: ``overlap=τ``, merged τ inner steps after its sync; ``-f{p}`` before it
  sets ``fragments=p`` (Streaming DiLoCo's fragments, synced in turn).
* ``-c`` (last, after any ``local`` method): ``compact=True``, sparse pieces in their compact
  form (the gaps' Rice code): the same run bit for bit, fewer bytes.
* ``shared-ddp``: ``SharedOptimizer(opt, threshold=QuantileThreshold(0.01), ddp=net)`` (as
  ``bench/workloads.py``'s ``shared-ddp-1%``): the best every-step gradshare path.

Bytes are what one rank sent (``bytes_sent`` of gradshare's objects; 4 per element and
all-reduce for DDP and model averaging). ``compression`` = 4 x numel x steps / bytes (vs dense
DDP over the same steps). gradshare sends 32 bits per entry (DL4J's format; plus per-tensor
headers; ``-c``: the compact form's ~8-9 bits); ``x@14bit`` is what the same entries would
give at SparseLoCo's 14 bits per entry (12-bit chunk index + 2-bit value): compression x 32 /
14, an upper bound (headers ignored; not for ``-c`` rows).
``identical``: the ranks' parameters are bit-identical at the end (all-gathered and compared).

Results go to ``--out`` (JSON, written after every run, so a killed job keeps what it ran;
runs of the same workload, world, steps, method and seed are replaced; each run keeps rank 0's
metric every 50 steps, its ``curve``) and a Pareto plot, ``<out>.png``: metric vs bytes per
rank (log x). A file with several worlds also gets ``<out>_worlds.png`` (:func:`plot_worlds`):
the loss over dense against the bytes, a line per world, and the defaults over the steps.
Runtime on 2 cores shared with other jobs (load ~9): gpt 1000 steps 2 ranks 150-300 s a run;
cnn 625 steps ~15 s; 600 steps at 8 ranks: gpt about 2 min a run, gpt2 about 4.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import itertools
import json
import math
import os
import re
import statistics
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _env import environment, free_port
from workloads import METHODS as EVERY_STEP
from workloads import WORKLOADS, Data, Workload, _numel

RESULTS = Path(__file__).resolve().parent / "results"
DILOCO_LR, DILOCO_MOMENTUM = 0.7, 0.9
METHOD = re.compile(
    r"^(?P<kind>local|diloco-dense|postlocal|torchft)(-H(?P<h>\d+))?(-d(?P<pct>[\d.]+))?"
    r"(-lr(?P<lr>[\d.]+))?(-b(?P<beta>[\d.]+))?(-w(?P<warmup>\d+))?(?P<mean>-mean)?"
    r"(?P<nesterov>-nesterov)?(-m(?P<momentum>[\d.]+))?(?P<agree>-agree(?P<ranks>\d+)?)?"
    r"(?P<snr>-snr)?(?P<share>-share(?P<cap>[\d.]+)?(?P<floor>-floor)?)?(-warm(?P<warm>\d+))?"
    r"(-f(?P<frags>\d+))?"
    r"(?P<overlap>-overlap(?P<tau>\d+)?)?(?P<compact>-c)?$"
)
CURVE_EVERY = 50
"""Rank 0's metric is also taken every this many steps (the run's ``curve``; its time is not
counted in ``seconds``): with H dividing 50, right after a sync, where the replica is the global
copy."""
_TORCHFT_RUNS = itertools.count()
"""torchft runs in this rank so far: each run's replicas join the lighthouse under new ids."""


SCHEDULED = {"gpt-cosine": "gpt"}
"""Workloads with an LR schedule, and the workload each runs: ``gpt-cosine`` is ``gpt`` whose
inner lr warms up linearly over the first 10 % of the steps, then follows a cosine down to
10 % of its peak (a fine-tuning run's schedule; ``LambdaLR`` on the inner optimizer, stepped
after each step)."""


def _gpt2(data: Data, seed: int) -> nn.Module:
    """Hugging Face's GPT-2 (``transformers.GPT2LMHeadModel``), small, with its own init and
    tied embeddings; returns the logits."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=data["vocab"],
        n_positions=64,
        n_embd=128,
        n_layer=3,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gpt = GPT2LMHeadModel(config)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.gpt(input_ids=x).logits

    return Logits()


def _trainer_adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW as Hugging Face's Trainer builds it by default (betas 0.9/0.999, no weight decay),
    at a from-scratch lr of 1e-3."""
    return torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)


OTHERS = {
    "gpt2": dataclasses.replace(
        WORKLOADS["gpt"],
        title="Hugging Face GPT-2 0.3M, Trainer's AdamW + clipping",
        build=_gpt2,
        optimizer=_trainer_adamw,
        settings="GPT2LMHeadModel (3 layers, width 128, tied), AdamW lr 1e-3 betas 0.9/0.999 "
        "wd 0, clip 1.0, 16x64 chars per rank",
    )
}
"""Workloads of this benchmark alone: ``gpt2``, a GPT that gradshare did not write (Hugging
Face's ``GPT2LMHeadModel``, its own init, tied embeddings; Trainer's AdamW) on the ``gpt``
workload's text."""


def workload_of(name: str) -> Workload:
    """The workload a name runs (``gpt-cosine``: ``gpt``'s model, data and optimizer)."""
    return OTHERS.get(name) or WORKLOADS[SCHEDULED.get(name, name)]


def _schedule(name: str, opt: torch.optim.Optimizer, steps: int) -> Any:
    if name not in SCHEDULED:
        return None
    warm = max(1, steps // 10)

    def factor(s: int) -> float:
        if s < warm:
            return (s + 1) / warm
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm)))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


@dataclass
class Method:
    """A wrapped model: ``net`` for the forward pass, ``opt`` to step, ``sent()`` its bytes."""

    net: nn.Module
    opt: Any
    sent: Callable[[], float]
    close: Callable[[], None] = lambda: None
    settings: dict[str, Any] | None = None
    """LocalSteps' resolved settings (density, decay, outer optimizer) for the record."""
    keep: tuple[Any, ...] = ()
    """What must live as long as the run (torchft's TCPStore)."""


def check_method(name: str) -> str:
    if name in ("dense", "shared-ddp") or METHOD.match(name):
        return name
    raise argparse.ArgumentTypeError(f"unknown method {name!r}")


def build(name: str, model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> Method:
    if name in ("dense", "shared-ddp"):
        setup = EVERY_STEP["dense" if name == "dense" else "shared-ddp-1%"](model, opt)
        return Method(setup.net, setup.opt, lambda: setup.sent(steps))
    m = METHOD.match(name)
    assert m is not None
    h = int(m["h"] or 10)
    if m["kind"] == "postlocal":
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        from torch.distributed.optim import PostLocalSGDOptimizer

        post = PostLocalSGDOptimizer(opt, PeriodicModelAverager(period=h, warmup_steps=0))
        return Method(model, post, lambda: 4.0 * _numel(model) * (steps // h))
    if m["kind"] == "torchft":
        return _torchft(model, opt, h, steps)
    import gradshare

    kwargs: dict[str, Any] = {}
    if m["kind"] == "diloco-dense":
        kwargs = {
            "dense": True,
            "outer_optimizer": lambda p: torch.optim.SGD(
                p, lr=DILOCO_LR, momentum=DILOCO_MOMENTUM, nesterov=True
            ),
        }
    else:
        if m["pct"]:
            kwargs["density"] = float(m["pct"]) / 100
        lr = float(m["lr"]) if m["lr"] else None
        from gradshare.distributed.local_steps import default_outer_lr

        rate = lr or default_outer_lr(opt)
        if m["nesterov"]:
            kwargs["outer_optimizer"] = lambda p: torch.optim.SGD(
                p, lr=lr or DILOCO_LR, momentum=DILOCO_MOMENTUM, nesterov=True
            )
        elif m["momentum"]:
            mu = float(m["momentum"])
            kwargs["outer_optimizer"] = lambda p: torch.optim.SGD(p, lr=rate, momentum=mu)
        elif m["agree"]:
            ranks = int(m["ranks"]) if m["ranks"] else None
            kwargs["outer_optimizer"] = lambda p: gradshare.AgreementSGD(p, lr=rate, ranks=ranks)
        elif lr is not None:
            kwargs["outer_optimizer"] = lambda p: torch.optim.SGD(p, lr=lr)
        if m["beta"]:
            kwargs["decay"] = float(m["beta"])
        if m["warmup"]:
            from gradshare.distributed.local_steps import DEFAULT_DENSITY

            density = float(m["pct"]) / 100 if m["pct"] else DEFAULT_DENSITY
            kwargs.pop("density", None)
            kwargs["threshold"] = gradshare.QuantileThreshold(density, warmup=int(m["warmup"]))
        if m["mean"]:
            kwargs["magnitude"] = "mean"
        if m["overlap"]:
            kwargs["overlap"] = int(m["tau"]) if m["tau"] else True
        if m["frags"]:
            kwargs["fragments"] = int(m["frags"])
        if m["compact"]:
            kwargs["compact"] = True
    sync = gradshare.LocalSteps(model, opt, sync_every=h, **kwargs)
    if m["warm"]:  # a study: the first n inner steps each end with a sync, then every h
        sync._schedule = _Warm(sync._schedule, int(m["warm"]))
    if m["snr"]:
        _scale_by_snr(sync, opt)
    if m["share"]:
        cap = float(m["cap"]) / 100 if m["cap"] else None
        _density_by_share(sync, cap, bool(m["floor"]))
    outer = sync.outer.param_groups[0]
    settings = {
        "sync_every": h,
        "density": sync.density,
        "decay": sync.decay,
        "magnitude": sync.options.magnitude,
        "outer": type(sync.outer).__name__,
        "outer_lr": outer["lr"],
        "outer_momentum": outer.get("momentum", 0.0),
    }
    return Method(model, opt, lambda: float(sync.bytes_sent), sync.close, settings)


def _scale_by_snr(sync: Any, opt: torch.optim.Optimizer) -> None:
    """A study (``-snr``): before each sync, each rank scales its Δ per element by
    sqrt(v / (μ² + σ²/M)), as Adam's step on M ranks' mean gradient is against its step on
    one rank's, with μ² and σ² estimated from the rank's own Adam moments (m's noise is
    (1-β1)/(1+β1) of σ²). Δ is scaled by moving the model, which the sync then replaces."""
    ranks = dist.get_world_size()
    start = {id(p): g for f in sync._fragments for g, p in zip(f.globals, f.params, strict=True)}

    def scale() -> None:
        for group in opt.param_groups:
            b1, b2 = group["betas"]
            c = (1 - b1) / (1 + b1)
            for p in group["params"]:
                state = opt.state.get(p)
                if not state:
                    continue
                t = float(state["step"])
                m = state["exp_avg"] / (1 - b1**t)
                v = state["exp_avg_sq"] / (1 - b2**t)
                noise = (v - m * m).clamp_(min=0) / (1 - c)
                signal = (m * m - c * noise).clamp_(min=0)
                r = (v / (signal + noise / ranks).clamp_(min=1e-30)).sqrt_()
                g = start[id(p)].reshape(p.shape)
                p.copy_(g - r.clamp_(1.0, ranks**0.5) * (g - p))

    _before_each_sync(sync, scale)


def _density_by_share(sync: Any, cap: float | None, floor: bool) -> None:
    """A study (``-share``, ``-share{pct}``): before each sync, the model's budget of entries
    (density x its elements) is parted among the tensors by their share of the update: one
    threshold over the whole model's β·residual + Δ, each tensor's density the fraction of its
    elements that cross it, at least density / 8 and at most 50 % (a bitmap past 1/16), which
    its own sampled threshold then aims at; with ``cap`` (``-share6``: 6 %) at most that, and
    the budget a capped tensor leaves is parted among the others; with ``floor`` (``-floor``)
    at least the density (more entries than the budget). Every rank parts its own budget (its
    messages differ in size, not in kind)."""
    density = sync.density
    pairs = [
        (enc, g, p)
        for f in sync._fragments
        for enc, g, p, whole in zip(f.encoders, f.globals, f.params, f.whole, strict=True)
        if not whole
    ]
    total = sum(p.numel() for _, _, p in pairs)
    most = 0.5 if cap is None else cap
    least = density if floor else density / 8

    def part() -> None:
        mags = []
        for enc, g, p in pairs:
            r = g.reshape(-1).float() - p.detach().reshape(-1).float()
            if enc.residual is not None:
                r.add_(enc.residual, alpha=sync.decay)
            mags.append(r.abs_())
        shares: dict[int, float] = {}
        budget = density * total
        while len(shares) < len(mags):  # a capped tensor's budget goes to the others
            rest = [i for i in range(len(mags)) if i not in shares]
            flat = torch.cat([mags[i] for i in rest])
            k = min(flat.numel(), max(1, round(budget)))
            t = torch.topk(flat, k, sorted=False).values.min()
            crossing = {i: int((mags[i] >= t).sum()) for i in rest}
            over = [i for i in rest if cap is not None and crossing[i] > cap * mags[i].numel()]
            if not over:
                shares.update({i: crossing[i] / mags[i].numel() for i in rest})
                break
            for i in over:
                shares[i] = most
                budget -= most * mags[i].numel()
        for i, (enc, _, _) in enumerate(pairs):
            enc.algorithm.density = min(max(shares[i], least), most)

    _before_each_sync(sync, part)


def _before_each_sync(sync: Any, study: Callable[[], None]) -> None:
    """Run ``study`` (without autograd) after the inner step that a sync follows, before the
    sync's round: LocalSteps' tick, which runs after every inner step, wrapped."""
    tick = sync._tick

    @torch.no_grad()
    def studied_tick() -> None:
        if sync._broken is None and sync._schedule.due(sync.steps + 1):
            study()
        tick()

    sync._tick = studied_tick


class _Warm:
    """LocalSteps' schedule, but every fragment is due at each of the first ``warm`` steps."""

    def __init__(self, schedule: Any, warm: int) -> None:
        self._schedule, self._warm = schedule, warm

    def due(self, step: int) -> list[Any]:
        return self._schedule.spans if step <= self._warm else self._schedule.due(step)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._schedule, name)


def _torchft(model: nn.Module, opt: torch.optim.Optimizer, h: int, steps: int) -> Method:
    """torchft's ``DiLoCo`` as published: one replica group per rank (world size 1 inside),
    a TCPStore of its own, a ``Manager`` that joins the parent's lighthouse, DiLoCo's outer
    Nesterov SGD 0.7 / 0.9; dense float32 pseudo-gradients all-reduced every ``h`` steps."""
    from datetime import timedelta

    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    rank, world = dist.get_rank(), dist.get_world_size()
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=world,
        use_async_quorum=False,
        init_sync=False,
        replica_id=f"r{rank}-{next(_TORCHFT_RUNS)}",
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=port,
        lighthouse_addr=os.environ["BENCH_LIGHTHOUSE"],
        hostname="127.0.0.1",
        timeout=timedelta(seconds=120),
    )
    outer = torch.optim.SGD(
        model.parameters(), lr=DILOCO_LR, momentum=DILOCO_MOMENTUM, nesterov=True
    )
    diloco = DiLoCo(manager, [model], opt, outer, sync_every=h)
    diloco.__enter__()

    def close() -> None:
        diloco.__exit__(None, None, None)
        manager.shutdown()

    settings = {
        "sync_every": h,
        "outer": "SGD",
        "outer_lr": DILOCO_LR,
        "outer_momentum": DILOCO_MOMENTUM,
        "torchft": _version("torchft"),
    }
    return Method(
        model, opt, lambda: 4.0 * _numel(model) * (steps // h), close, settings, keep=(store,)
    )


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def _identical(model: nn.Module, world: int) -> bool:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(every, flat)
    return all(torch.equal(every[0], f) for f in every[1:])


def _run(
    workload: str, method: str, rank: int, world: int, seed: int, steps: int, data: Data
) -> dict:
    w = workload_of(workload)
    model = w.build(data, seed)
    inner = w.optimizer(list(model.parameters()))
    setup = build(method, model, inner, steps)
    lr = _schedule(workload, inner, steps)
    g = torch.Generator().manual_seed(1000 * seed + rank)
    load, start = os.getloadavg()[0], time.perf_counter()
    curve, evaluated = [], 0.0
    for step in range(1, steps + 1):
        x, y = w.batch(data, g)
        setup.opt.zero_grad()
        w.loss(setup.net(x), y).backward()
        if w.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), w.clip)
        setup.opt.step()
        if lr is not None:
            lr.step()
        if rank == 0 and step % CURVE_EVERY == 0 and step < steps:  # after a sync at H | 50
            tick = time.perf_counter()
            curve.append([step, w.evaluate(model, data)])
            evaluated += time.perf_counter() - tick
    seconds = time.perf_counter() - start - evaluated
    setup.close()
    identical = _identical(model, world)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    crc = zlib.crc32(params.numpy().tobytes())
    return {
        "workload": workload,
        "world": world,
        "steps": steps,
        "method": method,
        "seed": seed,
        "metric": w.evaluate(model, data),
        "curve": curve,
        "bytes": setup.sent(),
        "dense": 4.0 * _numel(model) * steps,
        "numel": _numel(model),
        "identical": identical,
        "crc32": crc,
        "local_steps": setup.settings,
        "seconds": seconds,
        "load_start": load,
        "load_end": os.getloadavg()[0],
    }


def _key(r: dict) -> tuple:
    return (r["workload"], r["world"], r["steps"], r["method"], r["seed"])


def save(out: Path, runs: list[dict], command: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".lock"), "w") as lock:  # jobs may share an --out
        fcntl.flock(lock, fcntl.LOCK_EX)
        _save(out, runs, command)


def _save(out: Path, runs: list[dict], command: str) -> None:
    old = json.loads(out.read_text()) if out.exists() else {"runs": [], "commands": []}
    new = {_key(r) for r in runs}
    merged = [r for r in old["runs"] if _key(r) not in new] + runs
    commands = old.get("commands", [])
    if command not in commands:
        commands.append(command)
    tmp = out.with_suffix(".tmp")
    data = {"environment": environment(), "commands": commands, "runs": merged}
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(out)


def _rank(
    rank: int,
    world: int,
    port: int,
    workload: str,
    methods: list[str],
    seeds: list[int],
    steps: int,
    out: str,
    command: str,
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    data = workload_of(workload).load()
    for seed in seeds:
        for method in methods:
            run = _run(workload, method, rank, world, seed, steps, data)
            if rank == 0:
                save(Path(out), [run], command)
                print(
                    f"{workload} w{world} {steps} steps seed {seed} {method}: metric "
                    f"{run['metric']:.4f} bytes {run['bytes']:,.0f} "
                    f"({run['dense'] / run['bytes']:.1f}x) identical {run['identical']} "
                    f"{run['seconds']:.0f} s load {run['load_start']:.1f}",
                    flush=True,
                )
    dist.destroy_process_group()


# --- report ----------------------------------------------------------------------------------


@dataclass
class Row:
    workload: str
    world: int
    steps: int
    method: str
    metric_mean: float
    metric_sd: float
    vs_dense: float | None
    """metric mean / dense's (loss: lower is better) or metric - dense's (accuracy, points)."""
    bytes_per_rank: float
    compression: float
    compression_14bit: float | None
    identical: bool
    seconds: float
    load: float
    seeds: list[int]


def rows(runs: list[dict]) -> list[Row]:
    out = []
    for cfg in sorted({(r["workload"], r["world"], r["steps"]) for r in runs}):
        mine = [r for r in runs if (r["workload"], r["world"], r["steps"]) == cfg]
        methods = list(dict.fromkeys(r["method"] for r in mine))
        dense = [r["metric"] for r in mine if r["method"] == "dense"]
        for m in methods:
            rs = sorted((r for r in mine if r["method"] == m), key=lambda r: r["seed"])
            vals = [r["metric"] for r in rs]
            seeds = [r["seed"] for r in rs]
            mean = statistics.mean(vals)
            vs = None
            if dense:
                # compare against dense over the same seeds when they ran
                same = [r["metric"] for r in mine if r["method"] == "dense" and r["seed"] in seeds]
                d = same or dense
                higher = workload_of(cfg[0]).higher_is_better
                vs = mean - statistics.mean(d) if higher else mean / statistics.mean(d)
            sent = statistics.mean(r["bytes"] for r in rs)
            comp = statistics.mean(r["dense"] for r in rs) / sent
            gradshare = m.startswith(("local", "shared")) and not m.endswith("-c")
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            comp14 = comp * 32 / 14 if gradshare else None
            identical = all(r["identical"] for r in rs)
            seconds = statistics.mean(r["seconds"] for r in rs)
            load = statistics.mean(r["load_start"] for r in rs)
            row = (m, mean, sd, vs, sent, comp, comp14, identical, seconds, load, seeds)
            out.append(Row(*cfg, *row))
    return out


def table(rs: list[Row]) -> str:
    lines = []
    for cfg in dict.fromkeys((r.workload, r.world, r.steps) for r in rs):
        w = workload_of(cfg[0])
        vs = "- dense (pts)" if w.higher_is_better else "/ dense"
        mine = [r for r in rs if (r.workload, r.world, r.steps) == cfg]
        width = max(22, *(len(r.method) for r in mine))
        lines.append(f"\n{cfg[0]}: {w.title}, {cfg[1]} ranks, {cfg[2]} steps")
        lines.append(
            f"{'method':<{width}} {w.metric:>24} {vs:>13} {'bytes/rank':>14} {'compr.':>8} "
            f"{'x@14bit':>8} {'ident.':>6} {'s/run':>6} {'load':>5} seeds"
        )
        for r in mine:
            if r.vs_dense is None:
                v = "-"
            elif w.higher_is_better:
                v = f"{r.vs_dense:+.2f}"
            else:
                v = f"{r.vs_dense:.4f}"
            c14 = "-" if r.compression_14bit is None else f"{r.compression_14bit:.0f}x"
            lines.append(
                f"{r.method:<{width}} {r.metric_mean:>15.4f} ± {r.metric_sd:.4f} {v:>13} "
                f"{r.bytes_per_rank:>14,.0f} {r.compression:>7.1f}x {c14:>8} "
                f"{r.identical!s:>6} {r.seconds:>6.0f} {r.load:>5.1f} "
                f"{','.join(map(str, r.seeds))}"
            )
    return "\n".join(lines)


COLOURS = {
    "dense": ("DDP (dense)", "black", "o"),
    "local": ("LocalSteps", "tab:blue", "^"),
    "diloco": ("LocalSteps dense, Nesterov 0.7/0.9", "tab:purple", "v"),
    "postlocal": ("torch PostLocalSGD", "tab:orange", "s"),
    "shared": ("SharedOptimizer(ddp) 1%", "tab:green", "D"),
    "torchft": ("torchft DiLoCo, Nesterov 0.7/0.9", "tab:red", "P"),
}


def plot(rs: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfgs = list(dict.fromkeys((r.workload, r.world, r.steps) for r in rs))
    fig, axes = plt.subplots(1, len(cfgs), figsize=(8 * len(cfgs), 5.5), squeeze=False)
    for ax, cfg in zip(axes[0], cfgs, strict=True):
        w = workload_of(cfg[0])
        labelled = set()
        for r in (r for r in rs if (r.workload, r.world, r.steps) == cfg):
            label, colour, marker = COLOURS[r.method.split("-")[0]]
            ax.errorbar(
                r.bytes_per_rank,
                r.metric_mean,
                yerr=r.metric_sd,
                fmt=marker,
                color=colour,
                capsize=3,
                label=None if label in labelled else label,
            )
            labelled.add(label)
            ax.annotate(
                r.method,
                (r.bytes_per_rank, r.metric_mean),
                fontsize=7,
                xytext=(4, 3),
                textcoords="offset points",
            )
            if r.method == "dense":
                ax.axhline(r.metric_mean, color="grey", linestyle="--", linewidth=1)
                if not w.higher_is_better:
                    ax.axhline(
                        r.metric_mean * 1.02,
                        color="red",
                        linestyle=":",
                        linewidth=1,
                        label="dense + 2%",
                    )
        ax.set_xscale("log")
        better = "higher" if w.higher_is_better else "lower"
        ax.set(
            xlabel="bytes sent by one rank, whole run (log)",
            ylabel=f"{w.metric}, mean ± sd ({better} is better)",
            title=f"{cfg[0]}: {w.title}\n{cfg[1]} ranks, {cfg[2]} steps",
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


DENSITY_SWEEP = re.compile(r"^local-H10(-d[\d.]+)?$")
"""The methods of the density sweep that :func:`plot_worlds` draws as one line per world."""
WORLD_COLOURS = {2: "tab:blue", 4: "tab:orange", 8: "tab:red"}


def _curve(run: dict) -> dict[int, float]:
    """A run's metric by step: its ``curve`` and its final metric."""
    return dict([*run.get("curve", []), [run["steps"], run["metric"]]])


def plot_worlds(runs: list[dict], path: Path) -> bool:
    """Where a file holds one workload's runs at several worlds: the metric over dense's
    against the compression, one line per world through the density sweep
    (:data:`DENSITY_SWEEP`; dense DiLoCo marked), and over the steps (each run's ``curve``
    over dense's, seed by seed: the defaults, ``local-H10``). False where there is nothing
    to draw."""
    rs = [r for r in rows(runs) if r.vs_dense is not None]
    worlds = sorted({r.world for r in rs})
    if len(worlds) < 2 or len({(r.workload, r.steps) for r in rs}) != 1:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5.5))
    for world in worlds:
        colour = WORLD_COLOURS.get(world, "tab:gray")
        sweep = sorted(
            (r for r in rs if r.world == world and DENSITY_SWEEP.match(r.method)),
            key=lambda r: r.compression,
        )
        left.plot(
            [r.compression for r in sweep],
            [r.vs_dense for r in sweep],
            "o-",
            color=colour,
            label=f"{world} ranks: LocalSteps, H 10, density 6 / 4 / 2 / 1 %",
        )
        for r in sweep:
            left.annotate(
                r.method.removeprefix("local-H10"),
                (r.compression, r.vs_dense),
                fontsize=7,
                xytext=(4, 3),
                textcoords="offset points",
            )
        for r in (r for r in rs if r.world == world and r.method == "diloco-dense"):
            left.plot(r.compression, r.vs_dense, "v", color=colour, label=f"{world}: dense DiLoCo")
        dense = {
            r["seed"]: _curve(r) for r in runs if (r["world"], r["method"]) == (world, "dense")
        }
        points: dict[int, list[float]] = {}
        for r in runs:
            if r["world"] == world and r["method"] == "local-H10" and r["seed"] in dense:
                for step, value in _curve(r).items():
                    if step in dense[r["seed"]]:
                        points.setdefault(step, []).append(value / dense[r["seed"]][step])
        if points:
            steps = sorted(points)
            right.plot(
                steps,
                [statistics.mean(points[s]) for s in steps],
                "o-",
                color=colour,
                label=f"{world} ranks: LocalSteps defaults",
            )
    left.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    left.axvline(1000, color="grey", linestyle=":", linewidth=1, label="1,000x fewer bytes")
    left.set_xscale("log")
    left.set(
        xlabel="fewer bytes than dense DDP (log)",
        ylabel="validation loss / dense DDP's",
        title=f"{rs[0].workload}, {rs[0].steps} steps: the loss against bytes",
    )
    right.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    right.set(
        xlabel="inner step",
        ylabel="validation loss / dense DDP's at that step",
        title="the defaults over the run",
    )
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def report(paths: list[Path]) -> list[Row]:
    files = {p: json.loads(p.read_text())["runs"] for p in paths}
    rs = rows([r for mine in files.values() for r in mine])
    print(table(rs))
    for p, mine in files.items():
        plot(rows(mine), p.with_suffix(".png"))
        plot_worlds(mine, p.with_name(p.stem + "_worlds.png"))
    return rs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=["gpt", *SCHEDULED, *OTHERS, "cnn"], default="gpt")
    parser.add_argument(
        "--methods",
        nargs="+",
        type=check_method,
        default=["dense", "local-H10", "diloco-dense", "shared-ddp"],
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, help="default: the workload's (gpt 300, cnn 625)")
    parser.add_argument("--world", type=int, default=2, help="ranks (gloo, one host)")
    parser.add_argument("--out", type=Path, default=RESULTS / "local_steps.json")
    parser.add_argument(
        "--report",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="print the tables of these result files and redraw their plots; run nothing",
    )
    args = parser.parse_args(argv)
    if args.report:
        report(args.report)
        return
    steps = args.steps or workload_of(args.workload).steps
    command = "python bench/local_steps.py " + " ".join(sys.argv[1:] if argv is None else argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    lighthouse = None
    if any(m.startswith("torchft") for m in args.methods):  # torchft's coordinator, as published
        from torchft._torchft import LighthouseServer

        lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=args.world)
        os.environ.update(
            BENCH_LIGHTHOUSE=lighthouse.address(), GLOO_SOCKET_IFNAME="lo", RUST_LOG="warn"
        )
    plan = (args.workload, args.methods, args.seeds, steps, str(args.out), command)
    mp.spawn(_rank, args=(args.world, free_port(), *plan), nprocs=args.world)
    if lighthouse is not None:
        lighthouse.shutdown()
    report([args.out])
    print(f"\nsaved {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
