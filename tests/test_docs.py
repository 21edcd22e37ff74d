"""The snippets of README.md and docs/*.md run, and the README stays short.

Every ```python block runs; its first line says how:

- ``# runs on 2 ranks``: a whole torchrun script. It runs in two processes given torchrun's
  environment (``RANK``, ``WORLD_SIZE=2``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE=2``,
  ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT`` a free port of its own, found by rank 0 right
  before the block) and calls ``init_process_group("gloo")`` itself, as a script would.
- ``# fixture: NAME``: a deliberately partial block. ``FIXTURES[NAME]`` runs first, in the
  same namespace, and defines what the block uses; ``FIXTURE_RANKS[NAME]`` says on how many
  ranks (a fixture for 2 starts the process group itself).
- anything else: a whole single-process script, run once.

```diff blocks are not Python and do not run. Each README diff is checked against the full
loops it comes from instead: every added line, spaces and comments aside, must appear in a
Python block of docs/guide.md (which runs here) or in an example script (which
tests/test_examples.py and tests/test_integrations.py run); ``...`` in a line stands for
anything, and an import line matches when a counterpart imports the same names from the same
module.

All blocks run in one go, each in a fresh namespace inside one temporary directory: one
process for the single-process blocks and two for the 2-rank blocks, side by side, with one
thread each and ``GRADSHARE_KERNELS=0`` (the torch ops, equal to the kernels bit for bit; no
numba compilation). A block that fails is re-raised in its own test with each rank's
traceback; a rank stops at its first failing block, so later blocks report that instead.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest

from gradshare.distributed.hosts import rendezvous_port

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
GUIDE = ROOT / "docs" / "guide.md"
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
TIMEOUT_S = 180

FIXTURES = {
    "ddp-model": """
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradshare

dist.init_process_group("gloo")
rank = dist.get_rank()
os.makedirs("ckpt", exist_ok=True)
torch.manual_seed(rank)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)))
loader = [(torch.randn(4, 8), torch.randint(0, 2, (4,))) for _ in range(3)]
loss_fn = torch.nn.CrossEntropyLoss()
""",
}
FIXTURES["lighthouse"] = """
import os

from torchft._torchft import LighthouseServer

lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=60_000)
os.environ["TORCHFT_LIGHTHOUSE"] = lighthouse.address()
"""
FIXTURE_RANKS = {"ddp-model": 2}


@dataclass
class Block:
    where: str  # "docs/guide.md:42", the line of the opening fence
    code: str
    ranks: int
    fixture: str | None


def fenced(path: Path, lang: str) -> list[tuple[int, str]]:
    """(line of the opening fence, body) of every ```lang block in ``path``."""
    out, body, start = [], [], None
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if start is None and line.strip() == f"```{lang}":
            start, body = n, []
        elif start is not None and line.strip() == "```":
            out.append((start, "\n".join(body) + "\n"))
            start = None
        elif start is not None:
            body.append(line)
    return out


def python_blocks() -> list[Block]:
    blocks = []
    for path in DOCS:
        for line, code in fenced(path, "python"):
            first = code.splitlines()[0].strip() if code.strip() else ""
            fixture = None
            ranks = 1
            if m := re.fullmatch(r"# fixture: ([\w-]+)", first):
                fixture = m.group(1)
                ranks = FIXTURE_RANKS.get(fixture, 1)
            elif first == "# runs on 2 ranks":
                ranks = 2
            where = f"{path.relative_to(ROOT)}:{line}"
            blocks.append(Block(where, code, ranks, fixture))
    return blocks


BLOCKS = python_blocks()


# --------------------------------------------------------------------------- the workers


def _worker(spec_path: str, role: str) -> None:
    """Run this role's blocks in order; one JSON line of result per block into ``role``.jsonl."""
    import faulthandler

    import torch
    import torch.distributed as dist

    # a rank still running shortly before the runner kills it shows where it waits
    faulthandler.dump_traceback_later(TIMEOUT_S - 15, exit=False)
    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec_path).with_name(f"{role}.jsonl")
    for n, item in enumerate(spec[role]):
        if role != "solo":
            os.environ["MASTER_PORT"] = str(_block_port(Path(spec_path).parent, n, role))
        namespace: dict[str, Any] = {"__name__": "__main__"}
        try:
            if item["fixture"] is not None:
                exec(compile(FIXTURES[item["fixture"]], "fixture", "exec"), namespace)
            exec(compile(item["code"], item["where"], "exec"), namespace)
            result = {"where": item["where"], "error": None}
        except BaseException:
            result = {"where": item["where"], "error": traceback.format_exc()}
        with out.open("a") as f:
            f.write(json.dumps(result) + "\n")
        if result["error"] is not None:
            os._exit(1)  # a peer may wait in a collective: leave, so that it fails too
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def _block_port(folder: Path, n: int, role: str) -> int:
    """The port of the ``n``-th 2-rank block: rank 0 finds a free one right before the block
    and hands it to rank 1 in a file (ports found long before, all at once, could be taken by
    then by another test's store, which the ranks would join and wait in)."""
    path = folder / f"port-{n}"
    if role == "rank0":
        port = rendezvous_port()
        path.with_suffix(".tmp").write_text(str(port))
        path.with_suffix(".tmp").replace(path)
        return port
    deadline = time.monotonic() + TIMEOUT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 never reached block {n}")
        time.sleep(0.01)
    return int(path.read_text())


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, str | None]]:
    """Run every block; ``{where: {role: traceback or None}}`` for the roles that ran it."""
    solo = [b for b in BLOCKS if b.ranks == 1]
    pair = [b for b in BLOCKS if b.ranks == 2]
    spec = {
        "solo": [asdict(b) for b in solo],
        "rank0": [asdict(b) for b in pair],
        "rank1": [asdict(b) for b in pair],
    }
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        base = {**os.environ, "OMP_NUM_THREADS": "1", "GRADSHARE_KERNELS": "0"}
        ranks = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
        envs = {
            "solo": base,
            "rank0": {**base, **ranks, "RANK": "0", "LOCAL_RANK": "0"},
            "rank1": {**base, **ranks, "RANK": "1", "LOCAL_RANK": "1"},
        }
        procs = {
            role: subprocess.Popen(
                [sys.executable, __file__, str(spec_path), role],
                cwd=tmp,
                env=envs[role],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for role in spec
            if spec[role]
        }
        deadline = time.monotonic() + TIMEOUT_S
        logs = {}
        for role, proc in procs.items():
            try:
                logs[role] = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
            except subprocess.TimeoutExpired:
                proc.kill()
                logs[role] = proc.communicate()[0] + f"\n(killed after {TIMEOUT_S} s)"
        found: dict[str, dict[str, str | None]] = {b.where: {} for b in BLOCKS}
        for role in procs:
            path = spec_path.with_name(f"{role}.jsonl")
            lines = path.read_text().splitlines() if path.exists() else []
            done = [json.loads(line) for line in lines]
            for item in done:
                found[item["where"]][role] = item["error"]
            for item in spec[role][len(done) :]:
                found[item["where"]][role] = (
                    f"not run: {role} stopped before it (an earlier block failed or the "
                    f"process died); its output:\n{logs[role][-3000:]}"
                )
        return found


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_python_block_runs(block: Block, results: dict[str, dict[str, str | None]]) -> None:
    """The block runs to the end (on each of its ranks)."""
    if block.fixture is not None:
        assert block.fixture in FIXTURES, f"{block.where}: no fixture {block.fixture!r}"
    errors = {role: e for role, e in results[block.where].items() if e is not None}
    assert results[block.where], f"{block.where} was not run"
    if errors:
        raise AssertionError(
            "\n".join(f"{block.where} failed on {role}:\n{e}" for role, e in errors.items())
        )


def test_every_doc_has_blocks_that_run() -> None:
    """The markers are read: the guide has 2-rank scripts, fixtures and single-process ones."""
    guide = [b for b in BLOCKS if b.where.startswith("docs/guide.md")]
    assert {b.ranks for b in guide} == {1, 2}
    assert any(b.fixture for b in guide)


# --------------------------------------------------------------------------- the README diffs


def _squash(text: str) -> str:
    """Without comments (from `` #`` on) and without any whitespace."""
    return "".join("".join(line.split(" #")[0].split()) for line in text.splitlines())


def _imports(source: str) -> set[tuple[str, str]]:
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            names |= {(node.module, a.name) for a in node.names}
    return names


def _counterparts() -> list[str]:
    guide = [code for _, code in fenced(GUIDE, "python")]
    return guide + [p.read_text() for p in EXAMPLES]


def _matches(line: str, counterparts: list[str]) -> bool:
    if m := re.fullmatch(r"\s*from (\S+) import (.+?)\s*(#.*)?", line):
        wanted = {(m.group(1), n.strip()) for n in m.group(2).split(",")}
        return any(wanted <= _imports(c) for c in counterparts)
    pieces = _squash(line).split("...")
    for text in map(_squash, counterparts):
        at = 0
        for piece in pieces:
            at = text.find(piece, at)
            if at < 0:
                break
            at += len(piece)
        else:
            return True
    return False


README_DIFFS = fenced(README, "diff")


@pytest.mark.parametrize("diff", README_DIFFS, ids=[f"README.md:{n}" for n, _ in README_DIFFS])
def test_readme_diff_comes_from_a_tested_loop(diff: tuple[int, str]) -> None:
    """Every added line of a README diff is in a guide block or an example, both run by tests."""
    counterparts = _counterparts()
    added = [line[1:] for line in diff[1].splitlines() if line.startswith("+")]
    assert added, f"README.md:{diff[0]}: a diff with no added line"
    missing = [line for line in added if not _matches(line, counterparts)]
    assert not missing, (
        f"README.md:{diff[0]}: these added lines appear in no Python block of docs/guide.md "
        f"and no example: {missing}"
    )


def test_readme_fits_on_two_screens() -> None:
    """STYLE.md item 11: the README is short; the rest lives in docs/."""
    lines = len(README.read_text().splitlines())
    assert lines <= 200, f"README.md has {lines} lines; move detail to docs/"


def test_docs_name_public_paths_only() -> None:
    """The docs name ``gradshare.X`` only for X in ``gradshare.__all__`` or ``integrations``.

    The modules behind them are moving; what a user types must not.
    """
    import gradshare

    allowed = {*gradshare.__all__, "integrations", "__all__", "__version__"}
    bad = []
    for path in DOCS:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for m in re.finditer(r"\bgradshare\.(\w+)", line):
                if m.group(1) not in allowed:
                    bad.append(f"{path.relative_to(ROOT)}:{n}: gradshare.{m.group(1)}")
    assert not bad, bad


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
