"""SharedOptimizer over torch.distributed: real gloo processes on 127.0.0.1 (docs/design.md §6).

Each test runs on a world of processes (``tests/world.py``: a pooled one, or a fresh one where
a rank fails, hangs or is killed); the functions named ``_rank_*`` run on every rank and
return what the test asserts on.
"""

from __future__ import annotations

import copy
import hashlib
import os
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from gradshare import (
    AdaptiveThreshold,
    ExchangeError,
    FixedThreshold,
    ParallelWrapper,
    SharedOptimizer,
    exchange_messages,
)
from gradshare.app.datasets import mlp
from gradshare.distributed.hosts import rendezvous_port

from toys import flat, logged, toy_batches, toy_model
from world import pooled, spawn


def digest(model: nn.Module) -> str:
    return hashlib.sha256(flat(model).numpy().tobytes()).hexdigest()


# ---------------------------------------------------------------------- ranks


def _rank_train(rank: int, world: int, steps: int, magnitude: str = "threshold") -> dict:
    model = mlp(10, 3, hidden=16, seed=rank)  # different on purpose: rank 0's must win
    opt = SharedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        threshold=AdaptiveThreshold(1e-3),
        magnitude=magnitude,  # type: ignore[arg-type]
    )
    hashes, sizes, formats, values = [digest(model)], [], [], []
    for x, y in toy_batches(steps * world)[rank::world]:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        hashes.append(digest(model))
        assert opt.last_stats is not None
        sizes.append(opt.last_stats.message_bytes)
        formats.append(opt.last_stats.format)
        values.append((opt.last_stats.threshold, opt.last_stats.value))
    return {
        "hashes": hashes,
        "sizes": sizes,
        "bytes": opt.bytes_sent,
        "formats": formats,
        "values": values,
    }


def _rank_equivalence(rank: int, world: int, batches: list) -> torch.Tensor:
    model = mlp(10, 3, hidden=16, seed=0)
    opt = SharedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    for x, y in batches[rank::world]:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return flat(model)


def _rank_ddp_equivalence(rank: int, world: int, batches: list) -> dict:
    """The same training twice: a plain model, and the same model inside DDP with
    ``SharedOptimizer(..., ddp=net)``; also records that DDP left each gradient local."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    plain = mlp(10, 3, hidden=16, seed=0)
    opt = SharedOptimizer(torch.optim.AdamW(plain.parameters(), lr=1e-2), reduction="mean")
    model = mlp(10, 3, hidden=16, seed=0)
    net = DDP(model, bucket_cap_mb=0.001)  # several buckets
    ddp_opt = SharedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), ddp=net)
    # DDP averaged the gradients: with ddp= the updates are averaged too, by default
    assert ddp_opt.reduction == "mean"
    assert SharedOptimizer(torch.optim.SGD(mlp(10, 3).parameters(), lr=0.1)).reduction == "sum"
    local = []
    for x, y in batches[rank::world]:
        opt.zero_grad()
        F.cross_entropy(plain(x), y).backward()
        want = [p.grad.clone() for p in plain.parameters()]
        opt.step()
        ddp_opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        local.append(
            all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), want, strict=True))
        )
        ddp_opt.step()
    return {"plain": flat(plain), "ddp": flat(model), "local": local}


def _rank_dense(rank: int, world: int, batches: list) -> torch.Tensor:
    model = mlp(10, 3, hidden=16, seed=0)
    opt = SharedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dense=True, reduction="mean")
    for x, y in batches[rank::world]:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert opt.bytes_sent == 4 * opt.numel * opt.iteration
    return flat(model)


def _rank_fault(rank: int, world: int, kind: str) -> None:
    """The last rank fails at its fourth step; the others' step that meets the loss raises
    an ExchangeError whose message ends with how long that step took, timed here (start-up,
    imports and the first steps can take seconds on a loaded machine; they are not timed)."""
    model = mlp(10, 3, hidden=16, seed=0)
    # 3 s makes the lost-peer tests quick; a non-finite update is reported by the rank itself,
    # so that test gets room for a loaded machine instead of racing the peers' timeout
    timeout = 30 if kind == "nonfinite" else 3
    opt = SharedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), timeout=timeout)
    for step, (x, y) in enumerate(toy_batches(8 * world)[rank::world]):
        if rank == world - 1 and step == 3:
            if kind == "raise":
                raise ZeroDivisionError("rank's own bug")
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if kind == "hang":  # past the peer's 3 s timeout, with room for a loaded machine
                time.sleep(6)
            if kind == "nonfinite":
                x = x * float("nan")
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        start = time.monotonic()
        try:
            opt.step()
        except ExchangeError as e:
            raise ExchangeError(f"{e} [step {time.monotonic() - start:.2f} s]") from e


def _rank_keeps_residual(rank: int, world: int) -> float:
    """The survivor of a lost peer catches the error: its residual must hold what it had plus
    this step's update (its own message goes back), so a checkpoint then loses nothing."""
    model = mlp(10, 3, hidden=16, seed=0)
    opt = SharedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5), timeout=10, threshold=FixedThreshold(1e-3)
    )
    for step, (x, y) in enumerate(toy_batches(4 * world)[rank::world]):
        if rank == 1 and step == 2:
            return 0.0  # leaves: the others' exchange fails
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        residual = opt.encoder.residual  # type: ignore[union-attr]
        held = None if residual is None else residual.double().clone()
        try:
            opt.step()
        except ExchangeError:
            assert opt.last_stats is not None and opt.last_stats.entries > 0  # it had sent
            expected = held + opt._update.double()  # type: ignore[operator]
            return float((opt.encoder.residual.double() - expected).abs().max())  # type: ignore[union-attr]
    raise AssertionError("the exchange did not fail")


def _rank_sizes(rank: int, world: int) -> None:
    hidden = 16 if rank == 0 else 17
    SharedOptimizer(torch.optim.SGD(mlp(10, 3, hidden=hidden).parameters(), lr=0.1))


def _rank_huge_claim(rank: int, world: int) -> int:
    """Rank 1 claims a 2**40-word message for an 84-element vector; the others must refuse
    before allocating anything for it."""
    if rank == 1:
        header = torch.tensor([0, 2**40, 84, -1], dtype=torch.int64)  # status, words, numel, round
        dist.all_gather([torch.empty_like(header) for _ in range(world)], header)
        return 0
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        exchange_messages(None, 84, timeout=timedelta(seconds=10))
    finally:
        grown_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        assert grown_kb < 100_000, grown_kb
    return 0


def _rank_corrupt(rank: int, world: int) -> torch.Tensor:
    model = mlp(10, 3, hidden=16, seed=0)
    opt = SharedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), threshold=FixedThreshold(1e-4)
    )
    before = flat(model)
    if rank == 1:
        encode = opt.encoder.encode

        def corrupt(
            update: torch.Tensor, iteration: int, epoch: int = 0, **kw: bool
        ) -> torch.Tensor | None:
            message = encode(update, iteration, epoch, **kw)
            assert message is not None
            message[-1] = message.numel() * 1000  # an index far past N
            return message

        opt.encoder.encode = corrupt  # type: ignore[method-assign]
    x, y = toy_batches(1)[0]
    F.cross_entropy(model(x), y).backward()
    try:
        opt.step()
    finally:
        assert torch.equal(flat(model), before)  # nothing was applied
    return flat(model)


def _rank_conventions(rank: int, world: int) -> dict:
    """torch.optim's conventions on a SharedOptimizer: step hooks, an LR scheduler, GradScaler."""
    model = mlp(10, 3, hidden=16, seed=0)
    opt = SharedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    calls: list[str] = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post"))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    for x, y in toy_batches(3 * world)[rank::world]:
        opt.zero_grad()
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
    return {
        "calls": calls,
        "lr": opt.param_groups[0]["lr"],
        "iteration": opt.iteration,
        "params": flat(model),
    }


def _rank_checkpoint_schema(rank: int, world: int) -> dict:
    model = mlp(10, 3, hidden=16, seed=0)
    opt = SharedOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-2), threshold=FixedThreshold(1e-3)
    )
    for x, y in toy_batches(2 * world)[rank::world]:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    saved = opt.state_dict()
    out: dict = {"keys": sorted(saved), "ours": sorted(saved["gradshare"])}
    residual = opt.encoder.residual.clone()  # type: ignore[union-attr]
    fresh = SharedOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-2), threshold=FixedThreshold(1e-3)
    )
    old = {
        "optimizer": {k: v for k, v in saved.items() if k != "gradshare"},
        **{k: v for k, v in saved["gradshare"].items() if k not in ("world_size", "rank")},
    }
    fresh.load_state_dict(old)  # the schema of gradshare 0.1 still loads
    out["old_schema"] = torch.equal(fresh.encoder.residual, residual)  # type: ignore[union-attr]
    other = copy.deepcopy(saved)
    other["gradshare"]["rank"] = 1 - rank
    probe = SharedOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-2), threshold=FixedThreshold(1e-3)
    )
    try:
        probe.load_state_dict(other)
    except ValueError as e:
        out["other_rank"] = str(e)
    broken = copy.deepcopy(saved)
    broken["param_groups"] = broken["param_groups"] * 2  # the wrapped optimizer refuses
    try:
        probe.load_state_dict(broken)
    except ValueError as e:
        out["broken"] = str(e)
    out["untouched"] = probe.encoder.residual is None and probe.iteration == 0  # type: ignore[union-attr]
    return out


# ---------------------------------------------------------------------- tests


def _rank_logged(rank: int, world: int) -> list[tuple[str, str]]:
    """What a SharedOptimizer logs, DEBUG included, in two steps."""
    model = toy_model()
    with logged() as said:
        opt = SharedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), reduction="mean")
        for x, y in toy_batches(2):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    return said


class TestSharedOptimizer:
    def test_logs_its_configuration_and_each_step_at_debug(self) -> None:
        """SharedOptimizer declared a logger and said nothing of itself: one INFO line when
        built, a DEBUG line a step."""
        for said in (r.get() for r in pooled(_rank_logged, 2)):
            ours = [(level, m) for level, m in said if m.startswith("SharedOptimizer")]
            assert [level for level, _ in ours] == ["INFO", "DEBUG", "DEBUG"], said
            assert ours[0][1].startswith("SharedOptimizer over SGD: 4 parameter tensors"), said
            assert "world 2" in ours[0][1] and "flat exchange" in ours[0][1], said
            assert ours[2][1].startswith("SharedOptimizer step 1: sent "), said

    @pytest.mark.parametrize("world", [2, 3])
    def test_replicas_bit_identical_after_every_step(self, world: int) -> None:
        results = [r.get() for r in pooled(_rank_train, world, 12)]
        for r in results[1:]:
            assert r["hashes"] == results[0]["hashes"]
        assert len(set(results[0]["hashes"])) == 13  # it trained, every step
        for r in results:  # bytes counted = sizes of the messages it encoded
            assert r["bytes"] == sum(r["sizes"]) > 0
        assert {f for r in results for f in r["formats"]} & {"sparse", "bitmap"}

    def test_mean_magnitude_keeps_replicas_bit_identical(self) -> None:
        """Messages that carry the mean magnitude: every rank decodes the same sum."""
        results = [r.get() for r in pooled(_rank_train, 2, 12, "mean")]
        assert results[1]["hashes"] == results[0]["hashes"]
        assert len(set(results[0]["hashes"])) == 13
        values = [v for r in results for v in r["values"]]
        assert all(m >= t for t, m in values) and any(m > t for t, m in values)
        plain = [r.get() for r in pooled(_rank_train, 2, 12)]
        assert plain[0]["hashes"] != results[0]["hashes"]  # the option reached the encoder

    def test_same_parameters_as_parallel_wrapper(self) -> None:
        """The same data split through processes and through threads: bit-identical results."""
        batches = toy_batches(16)
        results = [r.get() for r in pooled(_rank_equivalence, 2, batches)]
        assert torch.equal(results[0], results[1])
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as in the ranks, so the local steps compute alike
        try:
            wrapper = ParallelWrapper(
                mlp(10, 3, hidden=16, seed=0),
                lambda p: torch.optim.Adam(p, lr=1e-2),
                F.cross_entropy,
                num_workers=2,
            )
            wrapper.fit(batches)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(flat(wrapper.model), results[0])


class TestWithDDP:
    """``SharedOptimizer(opt, ddp=net)``: the update-sharing path for a model kept in DDP."""

    def test_same_parameters_as_without_ddp(self) -> None:
        """DDP's all-reduce is replaced by a local no-op hook: each rank's optimizer steps on
        its own gradient and the updates are shared (averaged, as DDP averaged gradients),
        exactly as without DDP with ``reduction="mean"`` (several buckets, bit for bit, on
        every rank)."""
        results = [r.get() for r in pooled(_rank_ddp_equivalence, 2, toy_batches(12))]
        for r in results:
            assert torch.equal(r["ddp"], r["plain"])
            assert all(r["local"])  # gradients stayed local: nothing was all-reduced
        assert torch.equal(results[0]["ddp"], results[1]["ddp"])
        assert not torch.equal(results[0]["ddp"], flat(mlp(10, 3, hidden=16, seed=0)))

    def test_refuses_a_plain_module_and_missing_parameters(self) -> None:
        for r in pooled(_rank_ddp_refusals, 2):
            assert r.get() == ["TypeError", "ValueError"]


def _rank_ddp_refusals(rank: int, world: int) -> list[str]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = mlp(10, 3, hidden=16, seed=0)
    errors = []
    for ddp, params in ((model, model.parameters()), (DDP(model), [next(model.parameters())])):
        try:
            SharedOptimizer(torch.optim.SGD(params, lr=0.1), ddp=ddp)  # type: ignore[arg-type]
        except (TypeError, ValueError) as e:
            errors.append(type(e).__name__)
    return errors


def test_dense_mode_equals_sgd_on_the_union() -> None:
    """dense=True, reduction="mean", plain SGD: W ranks = one process on W batches a step."""
    batches = toy_batches(12)
    results = [r.get() for r in pooled(_rank_dense, 3, batches)]
    single = mlp(10, 3, hidden=16, seed=0)
    opt = torch.optim.SGD(single.parameters(), lr=0.1)
    for i in range(0, 12, 3):
        opt.zero_grad()
        x = torch.cat([b[0] for b in batches[i : i + 3]])
        y = torch.cat([b[1] for b in batches[i : i + 3]])
        F.cross_entropy(single(x), y).backward()
        opt.step()
    assert all(torch.equal(results[0], r) for r in results)
    torch.testing.assert_close(results[0], flat(single), rtol=1e-5, atol=1e-6)


class TestOptimizerConventions:
    def test_step_hooks_scheduler_and_grad_scaler(self) -> None:
        """`Optimizer.__init__` never ran, so registering a step hook raised AttributeError."""
        results = [r.get() for r in pooled(_rank_conventions, 2)]
        for r in results:
            assert r["calls"] == ["pre", "post"] * 3
            assert r["lr"] == pytest.approx(0.1 * 0.5**3) and r["iteration"] == 3
        assert torch.equal(results[0]["params"], results[1]["params"])

    def test_state_dict_keeps_torch_schema_and_loads_whole_or_not_at_all(self) -> None:
        for r in (res.get() for res in pooled(_rank_checkpoint_schema, 2)):
            assert r["keys"] == ["gradshare", "param_groups", "state"]
            assert r["ours"] == [
                "bytes_sent",
                "encoder",
                "format",
                "hierarchical",
                "iteration",
                "numel",
                "rank",
                "world_size",
            ]
            assert r["old_schema"]
            assert "saved by rank" in r["other_rank"]
            assert "parameter groups" in r["broken"] and r["untouched"]


class TestFaults:
    """A rank that fails stops every rank with a clear error within the timeout (3 s here)."""

    @pytest.mark.parametrize("kind", ["raise", "kill", "hang"])
    def test_lost_rank_fails_the_others(self, kind: str) -> None:
        """The survivor's step fails within the 3 s exchange timeout (plus slack for a loaded
        machine), far below the process group's own 60 s."""
        survivor, lost = spawn(_rank_fault, 2, kind, timeout=60, pg_timeout=60)
        assert survivor.error == "ExchangeError", survivor.traceback
        assert "Rank 0" in survivor.message and "timeout 3 s" in survivor.message
        step = re.search(r"\[step ([0-9.]+) s\]$", survivor.message)
        assert step is not None, survivor.message
        assert float(step[1]) < 15
        if kind == "raise":
            assert lost.error == "ZeroDivisionError"
        if kind == "kill":
            assert lost.error == "Killed" and lost.exitcode == -signal.SIGKILL

    def test_nonfinite_update_stops_every_rank(self) -> None:
        results = spawn(_rank_fault, 3, "nonfinite")
        # NonFiniteUpdate: a ValueError naming the cause, which the CLI tells from other errors
        assert results[2].error == "NonFiniteUpdate" and "non-finite" in results[2].message
        for r in results[:2]:
            assert r.error == "ExchangeError" and "rank(s) [2] failed" in r.message

    def test_failed_exchange_puts_own_message_back_into_the_residual(self) -> None:
        survivor, _ = spawn(_rank_keeps_residual, 2, timeout=60, pg_timeout=10)
        assert survivor.get() < 1e-6

    def test_parameter_sizes_differ(self) -> None:
        """Caught at construction by the settings check, the same readable error everywhere."""
        results = spawn(_rank_sizes, 2)
        for r in results:
            assert r.error == "ValueError", r.traceback
            assert "`numel` 227 on rank 0, 241 on rank 1" in r.message
        assert results[0].message == results[1].message

    def test_claimed_size_is_capped_before_any_allocation(self) -> None:
        zero, _, two = spawn(_rank_huge_claim, 3)
        for r in (zero, two):
            assert r.error == "ExchangeError", r.traceback
            assert "rank(s) [1] claim" in r.message and "longer than 88" in r.message

    def test_corrupted_message_rejected_on_every_rank(self) -> None:
        for r in spawn(_rank_corrupt, 3):
            assert r.error == "MessageError", r.traceback
            assert "Message from rank 1 is invalid" in r.message


def test_needs_a_process_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        SharedOptimizer(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))


def test_rendezvous_port_lies_below_the_ephemeral_range() -> None:
    """Below it no outgoing connection is given the port: a rank that connects before the
    store listens cannot connect to itself."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {rendezvous_port() for _ in range(20)}
    assert all(1024 <= p < low for p in ports) and len(ports) > 1


def test_destroy_process_group_stops_gloo_threads() -> None:
    """Guards a crash at exit ("terminate called without an active exception", SIGABRT):
    torch.distributed.nn.functional, imported lazily by torch (a first torch.optim optimizer
    does), binds the live default group as argument defaults, so destroy_process_group() could
    not free it and gloo's threads took the GIL during interpreter finalisation. Importing
    gradshare first must leave no gloo thread alive after destroy_process_group()."""
    script = (
        "import glob, tempfile\n"
        "import gradshare\n"
        "import torch, torch.distributed as dist\n"
        "store = dist.FileStore(tempfile.mkdtemp() + '/store', 1)\n"
        "dist.init_process_group('gloo', store=store, rank=0, world_size=1)\n"
        "torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)\n"
        "dist.all_gather([torch.empty(3)], torch.ones(3))\n"
        "assert any('gloo' in open(p).read() for p in glob.glob('/proc/self/task/*/comm'))\n"
        "dist.destroy_process_group()\n"
        "names = [open(p).read().strip() for p in glob.glob('/proc/self/task/*/comm')]\n"
        "print([n for n in names if 'gloo' in n])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"


def _launch_two_ranks(script: str, *args: str) -> list[subprocess.Popen]:
    """Start ranks 0 and 1 of ``tests/<script>`` the way torchrun would (env:// on a free
    port of 127.0.0.1), with OMP_NUM_THREADS=1 as torchrun sets it."""
    port = rendezvous_port()
    path = str(Path(__file__).resolve().parent / script)
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, path, *args],
                env=env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        )
    return procs


@pytest.mark.parametrize("mode", ["shared", "hook"])
def test_rank_exits_promptly_after_a_timed_out_exchange(mode: str) -> None:
    """`work.wait(timeout)` left the gloo operation running, so a rank that got the
    ExchangeError could not exit (not even after destroy_process_group) until gloo's own
    timeout, 30 minutes with a plain init_process_group. It must leave within seconds."""
    procs = _launch_two_ranks("fault_exit.py", mode)
    try:
        out, err = procs[0].communicate(timeout=90)
        assert "raised" in out, err[-3000:]
        assert "ExchangeError" in out or "Rank 0" in out, out
        left = float(out.split("leaving ")[1].split()[0])
        assert procs[0].returncode == 0, err[-3000:]
        assert time.monotonic() - left < 20  # the process ended soon after it decided to leave
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="needs Linux scheduling classes")
@pytest.mark.parametrize("mode", ["shared", "hook"])
def test_rank_exits_cleanly_right_after_its_last_exchange(mode: str) -> None:
    """Guards the SIGABRT at exit ("terminate called without an active exception") of a rank
    that leaves without destroy_process_group. gloo's worker thread drops a finished work
    some time after the operation ends; dropping a tensor that Python also refers to takes
    the GIL, and once the interpreter is finalising, CPython ends that thread with
    pthread_exit, which aborts inside torch's noexcept destructor. On a loaded machine the
    worker ran late and the process aborted, most often on a rank that left through an error.
    Here the load is deterministic (exit_busy.py: one CPU, gloo's threads in the idle class,
    C code holding the GIL before the exit): both ranks aborted every time with
    SharedOptimizer. gradshare now waits at exit until the backend has dropped its works."""
    procs = _launch_two_ranks("exit_busy.py", mode)
    try:
        for rank, p in enumerate(procs):
            out, err = p.communicate(timeout=120)
            assert "trained" in out, err[-3000:]
            assert "terminate called" not in err, err[-3000:]
            assert p.returncode == 0, f"rank {rank} exited {p.returncode}: {err[-3000:]}"
    finally:
        for p in procs:
            p.kill()
            p.wait()
