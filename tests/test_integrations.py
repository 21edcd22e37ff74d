"""Lightning and accelerate: the examples run as a user runs them, resume bit for bit, and end
where a plain-DDP run with the same hook and the same batches ends."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from gradshare.integrations import accelerate_rank_file, lightning_rank_file

from world import selected, spawn

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2
INSTALL = "pip install -e '.[integrations]'"
TORCHRUN = ("-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}")


def run_script(
    path: Path, *args: str | Path, launcher: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """Run a script of this checkout with its ``src`` importable, one thread per process
    (``launcher``: the module that starts it, e.g. torchrun's), on the torch ops (bit for bit
    the kernels'), so that its processes need not compile or load numba's kernels: the
    tests that run it are marked ``torch_ops``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRADSHARE_KERNELS": "0"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, *launcher, str(path), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=ROOT,
    )


def run_example(
    script: str, *args: str | Path, fails: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run ``examples/<script>``; it must succeed (or with ``fails``, exit non-zero)."""
    run = run_script(ROOT / "examples" / script, *args)
    assert (run.returncode != 0) == fails, run.stdout[-2000:] + run.stderr[-4000:]
    return run


def make_stale(rank_file: Path) -> None:
    """Leave ``rank_file`` as if from the save before: the same state, an older token (a
    rank killed while the checkpoint was written keeps its previous file)."""
    saved = torch.load(rank_file, weights_only=True)
    saved["token"] = {"id": saved["token"]["id"] ^ 1, "step": saved["token"]["step"] - 1}
    torch.save(saved, rank_file)


def assert_rank_files(paths: list[Path]) -> None:
    """Each rank wrote its own file, recording that rank and the world size."""
    for rank, path in enumerate(paths):
        saved = torch.load(path, weights_only=True)
        assert (saved["rank"], saved["world_size"]) == (rank, WORLD), path
        assert isinstance(saved["state"], dict) and saved["state"], path  # the hook state


def _plain_ddp(
    rank: int, world: int, batches: str, num_epochs: int, num_steps: int, share: str = "gradients"
) -> Any:
    """The oracle: torch DDP with the same hook (``share="updates"``: the same SharedOptimizer),
    model, optimizer and batches, no framework.

    ``batches="lightning"``: Lightning's DistributedSampler (seed 0, ``set_epoch`` each
    epoch), the first ``num_steps`` batches of each of ``num_epochs`` epochs, and the
    example's learning-rate warm-up (over 10 steps, set through ``opt.param_groups``).
    ``batches="accelerate"``: the unshuffled loader's batches dealt out round-robin (rank r
    takes r, r + world, ...), ``num_steps`` in all, epoch after epoch.
    """
    from torch.nn import functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from gradshare import AdaptiveThreshold, SharedOptimizer, register_threshold_hook
    from gradshare.app.datasets import digits, mlp

    split = digits(seed=0)
    data = TensorDataset(split.x_train, split.y_train)
    model = DDP(mlp(split.num_features, split.num_classes, seed=0))
    opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    if share == "gradients":
        register_threshold_hook(model, threshold=AdaptiveThreshold(1e-3))
    else:
        opt = SharedOptimizer(opt, ddp=model, threshold=AdaptiveThreshold(1e-3), reduction="mean")
    schedule: list[tuple[torch.Tensor, torch.Tensor]] = []
    if batches == "lightning":
        sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
        for epoch in range(num_epochs):
            sampler.set_epoch(epoch)
            schedule += list(DataLoader(data, batch_size=32, sampler=sampler))[:num_steps]
    else:
        mine = list(DataLoader(data, batch_size=32, drop_last=True))[rank::world]
        schedule = [mine[i % len(mine)] for i in range(num_steps)]
    for step, (x, y) in enumerate(schedule):
        if batches == "lightning":  # the example's warm-up, set through the optimizer
            for group in opt.param_groups:
                group["lr"] = 0.2 * min(1.0, (step + 1) / 10)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.module.parameters()])


def plain_ddp(*args: Any) -> torch.Tensor:
    results = [r.get() for r in spawn(_plain_ddp, WORLD, *args, timeout=180)]
    assert torch.equal(results[0], results[1])
    return results[0]


def _lightning_fits(tmp: Path) -> dict[str, Any]:
    """``tests/lightning_fits.py``: its twelve fits in one torchrun launch (the three shares,
    and local with overlap and fragments, straight through and resumed; the spoiled
    checkpoints; local steps with a grad scaler), and plain DDP for two shares, which runs
    meanwhile; then the example as a user runs it (Lightning's own launcher starts the
    processes), resuming the local fit from its ``step=3.ckpt`` in new processes."""
    with ThreadPoolExecutor(1) as meanwhile:
        oracles = {
            share: meanwhile.submit(plain_ddp, "lightning", 2, 3, share)
            for share in ("gradients", "updates")
        }
        run = run_script(ROOT / "tests" / "lightning_fits.py", tmp, launcher=TORCHRUN)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
        fits = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD)]
        local = tmp / "local"
        flags = "--share local --sync-every 2 --steps-per-epoch 3 --epochs 2".split()
        paths = ["--resume", local / "ckpt" / "step=3.ckpt", "--out", local / "resumed-new.pt"]
        resumed = run_example("lightning_ddp.py", *flags, *paths)
        return {
            "fits": fits,
            "tmp": tmp,
            "resumed_new": resumed,
            "oracles": {s: f.result() for s, f in oracles.items()},
        }


def _accelerate_runs(tmp: Path) -> dict[str, Any]:
    """``tests/accelerate_runs.py``: its seven runs from one parent (each in new processes),
    and plain DDP, which runs meanwhile. Each run's printed lines, by name."""
    with ThreadPoolExecutor(1) as meanwhile:
        oracle = meanwhile.submit(plain_ddp, "accelerate", 1, 26)
        run = run_script(ROOT / "tests" / "accelerate_runs.py", tmp)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
        said = dict(part.split("\n", 1) for part in run.stdout.split("=== ")[1:])
        return {"said": said, "tmp": tmp, "oracle": oracle.result()}


HANG_TIMEOUT = 10
"""``tests/lightning_hang.py``'s gradshare_timeout: also the process group's, which bounds its
start too. torchrun starts both ranks at once, so they meet within seconds even under load;
Lightning's own launcher starts rank 1 only once rank 0 imported everything, which needed
30 s here."""


def _hung_rank(tmp: Path) -> dict[str, Any]:
    """``tests/lightning_hang.py``: mostly waiting, so it runs beside the others."""
    script = ROOT / "tests" / "lightning_hang.py"
    return {"run": run_script(script, tmp / "done", HANG_TIMEOUT, launcher=TORCHRUN)}


@pytest.fixture(scope="module")
def runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Future[dict[str, Any]]]]:
    """The example runs of every selected test below, started at once: each launch spends
    most of its time starting processes (Lightning's launcher starts the second rank only
    once the first has imported everything), so they overlap well. A test waits for its own
    runs; any failure of theirs is raised there."""
    jobs: dict[str, Callable[[], dict[str, Any]]] = {}
    if importlib.util.find_spec("lightning") is not None and (
        selected(request, "test_resumed_fit_matches_the_straight_fit_and_plain_ddp")
        or selected(request, "test_local_steps_resume_bit_for_bit")
        or selected(request, "test_local_steps_with_overlap_and_fragments")
        or selected(request, "test_stale_and_plain_checkpoints")
        or selected(request, "test_a_step_the_scaler_skipped_still_syncs")
    ):
        jobs["lightning"] = partial(_lightning_fits, tmp_path_factory.mktemp("lightning"))
    if importlib.util.find_spec("accelerate") is not None and (
        selected(request, "test_resumed_run_matches_the_straight_run_and_plain_ddp")
        or selected(request, "test_local_steps_resume_at_any_step")
        or selected(request, "test_rank_files_newer_than_accelerates_are_refused")
    ):
        jobs["accelerate"] = partial(_accelerate_runs, tmp_path_factory.mktemp("accelerate"))
    if importlib.util.find_spec("lightning") is not None and selected(
        request, "test_a_hung_rank_holds_the_other_for_gradshare_timeout_at_most"
    ):
        jobs["hang"] = partial(_hung_rank, tmp_path_factory.mktemp("hang"))
    with ThreadPoolExecutor(max(1, len(jobs))) as pool:
        yield {name: pool.submit(job) for name, job in jobs.items()}


@pytest.mark.torch_ops
class TestLightning:
    """``GradshareDDPStrategy``, sharing gradients (the hook), updates (SharedOptimizer) or
    local steps: a fit resumed from a checkpoint ends at the parameters of the fit that ran
    straight through, and, sharing gradients or updates, both at those of plain DDP. The
    resumes run in the same processes, with a fresh model, strategy and Trainer
    (``tests/lightning_fits.py``); the local fit is also resumed in new processes, by the
    example launched as a user launches it."""

    @pytest.mark.parametrize("share", ["gradients", "updates"])
    def test_resumed_fit_matches_the_straight_fit_and_plain_ddp(
        self, runs: dict[str, Future[dict[str, Any]]], share: str
    ) -> None:
        pytest.importorskip("lightning", reason=f"needs Lightning: {INSTALL}")
        run = runs["lightning"].result()
        for fit in (f"{share}-straight", f"{share}-resumed"):
            assert [ranks[fit][1] for ranks in run["fits"]] == [None] * WORLD, run["fits"]
            assert "x less" in run["fits"][0][fit][0]
        ckpt = run["tmp"] / share / "ckpt"
        first = ckpt / "step=3.ckpt"
        assert first.exists(), sorted(p.name for p in ckpt.iterdir())
        assert_rank_files([lightning_rank_file(first, r) for r in range(WORLD)])
        whole = torch.load(run["tmp"] / share / "straight.pt", weights_only=True)
        resumed = torch.load(run["tmp"] / share / "resumed.pt", weights_only=True)
        assert torch.equal(whole, resumed)
        assert torch.equal(whole, run["oracles"][share])

    def test_local_steps_resume_bit_for_bit(self, runs: dict[str, Future[dict[str, Any]]]) -> None:
        """``share="local"``: no all-reduce, LocalSteps syncs every 2 steps; saved at step 3,
        between two syncs, each rank's own replica and optimizer state in its rank file."""
        pytest.importorskip("lightning", reason=f"needs Lightning: {INSTALL}")
        run = runs["lightning"].result()
        for fit in ("local-straight", "local-resumed"):
            assert [ranks[fit][1] for ranks in run["fits"]] == [None] * WORLD, run["fits"]
        said = run["fits"][0]["local-straight"][0]
        sent = r"step 6: rank 0 sent [\d,]+ B vs [\d,]+ B dense \(\d+x less\)"
        assert re.search(sent, said), said
        first = run["tmp"] / "local" / "ckpt" / "step=3.ckpt"
        assert_rank_files([lightning_rank_file(first, r) for r in range(WORLD)])
        files = [torch.load(lightning_rank_file(first, r), weights_only=True) for r in range(WORLD)]
        mine = [f["state"]["local"]["params"] for f in files]
        assert any(not torch.equal(a, b) for a, b in zip(*mine, strict=True))  # replicas differ
        whole = torch.load(run["tmp"] / "local" / "straight.pt", weights_only=True)
        resumed = torch.load(run["tmp"] / "local" / "resumed.pt", weights_only=True)
        assert torch.equal(whole, resumed)
        # the example as a user runs it, resumed in new processes: the same end
        said = run["resumed_new"].stdout
        assert re.search(r"step 6: rank 0 sent [\d,]+ B vs [\d,]+ B dense", said), said
        new = torch.load(run["tmp"] / "local" / "resumed-new.pt", weights_only=True)
        assert torch.equal(whole, new)

    def test_local_steps_with_overlap_and_fragments(
        self, runs: dict[str, Future[dict[str, Any]]]
    ) -> None:
        """``overlap`` and ``fragments`` reach LocalSteps through the strategy: 2 fragments
        synced in turn, each exchange merged a step later; saved at step 3 with a round in
        flight (its mean and fragment in each rank's file), resumed to the same end."""
        pytest.importorskip("lightning", reason=f"needs Lightning: {INSTALL}")
        run = runs["lightning"].result()
        for fit in ("local-overlap-straight", "local-overlap-resumed"):
            assert [ranks[fit][1] for ranks in run["fits"]] == [None] * WORLD, run["fits"]
        first = run["tmp"] / "local-overlap" / "ckpt" / "step=3.ckpt"
        files = [torch.load(lightning_rank_file(first, r), weights_only=True) for r in range(WORLD)]
        for file in files:
            sync = file["state"]["local"]["state"]
            assert (sync["settings"]["overlap"], sync["settings"]["fragments"]) == (1, 2)
            assert sync["pending"] is not None and sync["fragment"] in (0, 1), sync["fragment"]
        tmp = run["tmp"] / "local-overlap"
        whole = torch.load(tmp / "straight.pt", weights_only=True)
        assert torch.equal(whole, torch.load(tmp / "resumed.pt", weights_only=True))
        plain = torch.load(run["tmp"] / "local" / "straight.pt", weights_only=True)
        assert not torch.equal(whole, plain)  # the settings changed the run

    def test_stale_and_plain_checkpoints(self, runs: dict[str, Future[dict[str, Any]]]) -> None:
        """A rank file left from the save before was accepted (exit 0, other parameters); a
        checkpoint of plain "ddp" (no rank files) could not be resumed at all: now refused on
        every rank, unless ``resume_without_rank_files=True``. On a copy of the gradients
        fit's first checkpoint (step 3, the end of its first epoch)."""
        pytest.importorskip("lightning", reason=f"needs Lightning: {INSTALL}")
        run = runs["lightning"].result()
        saved = run["tmp"] / "spoiled" / "step=3.ckpt"  # a copy of the gradients fit's
        original = torch.load(run["tmp"] / "gradients" / "ckpt" / saved.name, weights_only=False)
        assert original["gradshare"]["step"] == 3
        own, other = (ranks["stale"][1] or "" for ranks in run["fits"])
        assert f"{lightning_rank_file(saved, 1)} is from another save" in other, other
        assert "the file is of step 2, the checkpoint of step 3" in other
        assert "Rank(s) [1] could not load their gradshare rank file" in own, own
        for ranks in run["fits"]:
            assert "resume_without_rank_files=True" in (ranks["plain"][1] or ""), ranks["plain"]
            assert ranks["plain-allowed"][1] is None, ranks["plain-allowed"]
        assert "step 6:" in run["fits"][0]["plain-allowed"][0]

    def test_a_step_the_scaler_skipped_still_syncs(
        self, runs: dict[str, Future[dict[str, Any]]]
    ) -> None:
        """``precision="16-mixed"``: the scaler skips the step of a rank whose gradients
        overflowed, and LocalSteps, counting steps, put that rank's syncs a step late in
        every round, so the ranks' collectives no longer matched (the launch hung). The
        strategy now passes the precision plugin's scaler (``LocalSteps(grad_scaler=...)``): rank 1
        overflows at step 1 of 6, a sync every 2, and the replicas end bit-identical."""
        pytest.importorskip("lightning", reason=f"needs Lightning: {INSTALL}")
        run = runs["lightning"].result()
        ranks = [fits["local-scaler"] for fits in run["fits"]]
        for rank in ranks:
            assert rank["error"] is None and rank["reached"] is True, ranks
            assert rank["replicas_equal"] is True, ranks
        assert ranks[1]["scale"] < ranks[0]["scale"]  # rank 1's scaler skipped a step

    def test_process_group_timeout_follows_gradshare_timeout(self) -> None:
        """Lightning broadcasts on the default group every step, under DDPStrategy's timeout
        (torch's 30 minutes): a hung rank held the others that long whatever
        ``gradshare_timeout`` said."""
        pytest.importorskip("lightning", reason=f"needs Lightning: {INSTALL}")
        from datetime import timedelta

        from gradshare._checks import DEFAULT_TIMEOUT
        from gradshare.integrations import GradshareDDPStrategy

        assert GradshareDDPStrategy(gradshare_timeout=20)._timeout == timedelta(seconds=20)
        assert GradshareDDPStrategy()._timeout == timedelta(seconds=DEFAULT_TIMEOUT)
        given = GradshareDDPStrategy(gradshare_timeout=20, timeout=timedelta(seconds=99))
        assert given._timeout == timedelta(seconds=99)

    def test_a_hung_rank_holds_the_other_for_gradshare_timeout_at_most(
        self, runs: dict[str, Future[dict[str, Any]]]
    ) -> None:
        """Rank 0 hangs after step 2, with no sync due: rank 1 waits in Lightning's own
        per-step broadcast from rank 0 (its error swallowed by Lightning), which held it
        torch's 30 minutes; now ``gradshare_timeout`` (:data:`HANG_TIMEOUT`) bounds the
        wait. The fit goes on alone to its end, where the replicas are averaged
        (``LocalSteps.average``: the run did not end on a sync); that finds the peer gone
        within the timeout too, and says so, where the fit used to end with exit 0."""
        pytest.importorskip("lightning", reason=f"needs Lightning: {INSTALL}")
        run = runs["hang"].result()["run"]
        found = re.search(r"rank 1, ([\d.]+) s after step 2: (.*)", run.stdout)
        assert found, run.stdout[-2000:] + run.stderr[-3000:]
        waited = float(found.group(1))
        assert 2 * (HANG_TIMEOUT - 0.5) <= waited < 2 * HANG_TIMEOUT + 30, run.stdout
        assert "the average of the replicas failed" in found.group(2), run.stdout

    def test_bad_settings_are_refused(self) -> None:
        pytest.importorskip("lightning", reason=f"needs Lightning: {INSTALL}")
        from gradshare.integrations import GradshareDDPStrategy

        with pytest.raises(ValueError, match='"updates" or "local"'):
            GradshareDDPStrategy(share="weights")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="registers gradshare's hook itself"):
            GradshareDDPStrategy(ddp_comm_hook=lambda state, bucket: None)


@pytest.mark.torch_ops
class TestAccelerate:
    """``register_rank_checkpointing``: ``save_state`` mid-epoch, ``load_state`` in new
    processes, and the run ends at the parameters of the straight run and of plain DDP
    (``tests/accelerate_runs.py``: every run in new processes, one parent)."""

    def test_resumed_run_matches_the_straight_run_and_plain_ddp(
        self, runs: dict[str, Future[dict[str, Any]]]
    ) -> None:
        pytest.importorskip("accelerate", reason=f"needs accelerate: {INSTALL}")
        run = runs["accelerate"].result()
        said, tmp = run["said"], run["tmp"] / "gradients"
        assert "x less" in said["gradients-straight"], said
        assert_rank_files([accelerate_rank_file(tmp / "ckpt", r) for r in range(WORLD)])
        assert "resumed from step 25" in said["gradients-resumed"], said
        whole = torch.load(tmp / "straight.pt", weights_only=True)
        resumed = torch.load(tmp / "resumed.pt", weights_only=True)
        assert torch.equal(whole, resumed)
        assert torch.equal(whole, run["oracle"])
        # resumed from already, then rank 1's file left as from another save: refused
        named = f"{accelerate_rank_file(tmp / 'ckpt', 1)} is from another save"
        stale = said["stale"]  # accelerate shows one failed rank's error
        assert named in stale or "Rank(s) [1] could not load their gradshare" in stale, stale
        assert "step 26:" not in stale

    def test_rank_files_newer_than_accelerates_are_refused(
        self, runs: dict[str, Future[dict[str, Any]]]
    ) -> None:
        """The rank files are written in a save pre-hook, before accelerate writes model and
        optimizer, and the token with them: the main process killed in between left step-26
        rank files beside the step-25 model, and ``load_state`` took them (exit 0, the hook
        one iteration ahead). The token is now written once every rank is through
        ``save_state``: each rank refuses its file, naming both steps."""
        pytest.importorskip("accelerate", reason=f"needs accelerate: {INSTALL}")
        run = runs["accelerate"].result()
        said, cut = run["said"], run["tmp"] / "cut" / "ckpt"
        assert "resumed from step 25" in said["cut"] and "saved step 26" not in said["cut"]
        refused = said["cut-resumed"]  # accelerate shows one failed rank's error
        assert any(
            f"{accelerate_rank_file(cut, r)} is from another save than "
            f"{cut / 'gradshare-save.json'}: the file is of step 26, the checkpoint of step 25"
            in refused
            for r in range(WORLD)
        ), refused
        assert "step 26:" not in refused

    def test_local_steps_resume_at_any_step(self, runs: dict[str, Future[dict[str, Any]]]) -> None:
        """``--share local`` (no_sync, LocalSteps every 4 steps): saved at step 25, between
        two syncs, resumed in new processes, it ends where the straight run ends."""
        pytest.importorskip("accelerate", reason=f"needs accelerate: {INSTALL}")
        run = runs["accelerate"].result()
        said, tmp = run["said"], run["tmp"] / "local"
        sent = r"step 26: rank 0 sent [\d,]+ B vs [\d,]+ B dense \(\d+x less\)"
        assert re.search(sent, said["local-straight"]), said
        assert_rank_files([accelerate_rank_file(tmp / "ckpt", r) for r in range(WORLD)])
        assert "resumed from step 25" in said["local-resumed"], said
        whole = torch.load(tmp / "straight.pt", weights_only=True)
        resumed = torch.load(tmp / "resumed.pt", weights_only=True)
        assert torch.equal(whole, resumed)


class _Counter:
    def __init__(self, n: int = 0) -> None:
        self.n = n

    def state_dict(self) -> dict[str, Any]:
        return {"n": torch.tensor(self.n)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = int(state["n"])


class TestRankFiles:
    """The per-rank files: written whole, read with ``weights_only``, another rank's refused."""

    def test_round_trip(self, tmp_path: Path) -> None:
        from gradshare.integrations import load_rank_state, save_rank_state

        path = save_rank_state(_Counter(7), tmp_path / "sub" / "r.pt")
        assert sorted(p.name for p in path.parent.iterdir()) == ["r.pt"]  # no temporary left
        restored = _Counter()
        load_rank_state(restored, path)
        assert restored.n == 7

    def test_another_ranks_file_is_refused(self, tmp_path: Path) -> None:
        from gradshare.integrations import load_rank_state

        path = tmp_path / "r.pt"
        torch.save({"rank": 1, "world_size": 2, "state": {"n": torch.tensor(3)}}, path)
        restored = _Counter(5)
        with pytest.raises(ValueError, match="written by rank 1 of 2, this is rank 0 of 1"):
            load_rank_state(restored, path)
        assert restored.n == 5

    def test_a_missing_file_says_what_to_do(self, tmp_path: Path) -> None:
        from gradshare.integrations import load_rank_state

        with pytest.raises(FileNotFoundError, match="every rank writes its own file"):
            load_rank_state(_Counter(), tmp_path / "absent.pt")


def _rank_load(
    rank: int, world: int, tmp: Path, tokens: list[dict | None], ckpt: dict | None
) -> str:
    """Rank ``rank`` writes its file with ``tokens[rank]``, then every rank loads its own,
    ``ckpt`` being the framework checkpoint's token; returns the error, or "loaded"."""
    from gradshare.integrations import SaveToken, load_rank_state, save_rank_state

    token = None if tokens[rank] is None else SaveToken(**tokens[rank])
    path = save_rank_state(_Counter(10 + rank), tmp / f"r{rank}.pt", token=token)
    restored = _Counter(-1)
    try:
        load_rank_state(restored, path, token=None if ckpt is None else SaveToken(**ckpt))
    except ValueError as e:
        assert restored.n == -1  # nothing restored
        return str(e)
    assert restored.n == 10 + rank
    return "loaded"


def _rank_save_and_load(rank: int, world: int, tmp: Path) -> tuple[int, int]:
    """Two saves with agreed tokens: every rank draws the same id, new each save."""
    from gradshare.integrations import load_rank_state, new_token, save_rank_state

    first, second = new_token(5), new_token(10)
    assert first.id != second.id and (first.step, second.step) == (5, 10)
    path = save_rank_state(_Counter(rank), tmp / f"r{rank}.pt", token=second)
    restored = _Counter(-1)
    load_rank_state(restored, path, token=second)
    return second.id, restored.n


class TestSaveTokens:
    """Every save's token, in each rank's file and in the framework checkpoint: a rank file
    left from another save (a rank killed while a checkpoint was written) was accepted, and
    the fit resumed, exit 0, to other parameters."""

    def test_tokens_are_agreed_and_round_trip(self, tmp_path: Path) -> None:
        results = [r.get() for r in spawn(_rank_save_and_load, WORLD, tmp_path)]
        ids, restored = zip(*results, strict=True)
        assert len(set(ids)) == 1 and list(restored) == list(range(WORLD))

    def test_a_stale_rank_file_is_refused_on_every_rank(self, tmp_path: Path) -> None:
        """Rank 1's file is left from the save of step 5; the checkpoint is of step 10."""
        new, old = {"id": 7, "step": 10}, {"id": 3, "step": 5}
        out = [r.get() for r in spawn(_rank_load, WORLD, tmp_path, [new, old], new)]
        assert out[1].startswith(f"{tmp_path / 'r1.pt'} is from another save"), out[1]
        assert "the file is of step 5, the checkpoint of step 10" in out[1]
        assert "Rank(s) [1] could not load" in out[0], out[0]

    def test_ranks_with_files_of_different_saves_refuse_alike(self, tmp_path: Path) -> None:
        """No token from the framework: the ranks' own files still must agree."""
        new, old = {"id": 7, "step": 10}, {"id": 3, "step": 5}
        for r in spawn(_rank_load, WORLD, tmp_path, [new, old], None):
            assert "different saves (rank 0's of step 10, rank 1's of step 5" in r.get()

    def test_a_damaged_file_is_named(self, tmp_path: Path) -> None:
        """torch's raw zip error came without the file's name."""
        from gradshare.integrations import load_rank_state

        path = tmp_path / "r.pt"
        path.write_bytes(b"PK\x03\x04 cut short")
        with pytest.raises(ValueError, match=f"Cannot read gradshare's rank file {path}"):
            load_rank_state(_Counter(), path)


def _python(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )


class TestOptionalImports:
    """Lightning, accelerate and transformers stay optional: gradshare never imports them on
    its own."""

    def test_importing_gradshare_imports_neither(self) -> None:
        run = _python(
            "import sys, gradshare, gradshare.integrations\n"
            "print(sorted({'lightning', 'accelerate', 'transformers'} & set(sys.modules)))"
        )
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip() == "[]"

    def test_the_strategy_without_lightning_says_how_to_install(self) -> None:
        run = _python(
            "import sys; sys.modules['lightning'] = None\n"
            "from gradshare.integrations import GradshareDDPStrategy"
        )
        assert run.returncode != 0
        assert INSTALL in run.stderr

    def test_the_callback_without_transformers_says_how_to_install(self) -> None:
        run = _python(
            "import sys; sys.modules['transformers'] = None\n"
            "from gradshare.integrations import GradshareCallback"
        )
        assert run.returncode != 0
        assert INSTALL in run.stderr
