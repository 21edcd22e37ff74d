"""Two machines on one host: network namespaces joined by a shaped veth pair, one torchrun each.

``bench/multinode.py`` builds them (10.77.0.1 and 10.77.0.2, each end limited to 1 Gbit/s
with ``tc tbf``) and removes them afterwards. Needs root and iproute2 (``ip``, ``tc``): the
tests skip with the reason otherwise.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import multinode  # noqa: E402

WHY = multinode.can_shape()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"two simulated machines: {WHY}")


def test_four_ranks_on_two_machines_end_bit_identical(tmp_path: Path) -> None:
    """torchrun_shared.py for 8 steps on 2 machines x 2 ranks over the veth link, with
    ``--hierarchical`` (a group within each machine, one across the link): all four ranks end
    with the same parameters, bit for bit, and the traffic crossed the link. The flat
    exchange across the link is the one the worlds of 2 and 3 ranks on 127.0.0.1 test; its
    launch here (30 s) added nothing of the two machines that this one lacks."""
    args = ["--epochs", "1", "--steps", "8", "--out", tmp_path / "rank{rank}.pt", "--hierarchical"]
    with multinode.two_nodes("1gbit") as nodes:
        runs = multinode.torchrun_two_nodes(
            nodes, ROOT / "examples" / "torchrun_shared.py", args, timeout=180
        )
        crossed = [multinode.link_tx_bytes(node) for node in nodes]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    params = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(4)]
    for p in params[1:]:
        assert torch.equal(p, params[0])
    assert min(crossed) > 20_000  # messages (and the 77 kB initial broadcast) crossed it
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20)
    assert nodes[0].namespace not in left.stdout and nodes[1].namespace not in left.stdout
