"""Two machines on one: two network namespaces joined by a shaped veth pair, torchrun in each.

Run:  .venv/bin/python bench/multinode.py            (as root; 13 minutes on a busy 2-core VM)
      .venv/bin/python bench/multinode.py --model gpt-0.45m --steps 3 --rate 100mbit

Each "machine" is a network namespace with its loopback up and one end of a veth pair
(10.77.0.1/24 and 10.77.0.2/24); each end's egress is limited with ``tc qdisc ... tbf`` (1
Gbit/s by default), so traffic between the machines crosses a shaped link in each direction
while the ranks of one machine talk over its own unshaped loopback, as on real hosts. One
``torchrun --nnodes=2 --nproc_per_node=2 --rdzv-backend=c10d --rdzv-endpoint=10.77.0.1:29400``
runs in each namespace (``ip netns exec``; the first hosts the rendezvous), and gloo uses the
veth (``GLOO_SOCKET_IFNAME``). The namespaces are removed afterwards, whatever happens.

The helpers (:func:`can_shape`, :func:`two_nodes`, :func:`torchrun_two_nodes`) are imported by
``tests/test_multinode.py``. The benchmark trains the GPT of ``bench/_models.py`` (AdamW, 2
windows of 64 characters per rank) with 2 machines x 2 ranks and each method:

* ``dense``: DDP's all-reduce (default 25 MB buckets);
* ``powersgd-4``: PyTorch's PowerSGD hook, rank 4, one bucket (``start_powerSGD_iter=2``);
* ``shared``: ``gradshare.SharedOptimizer(adamw)``, every rank's message all-gathered;
* ``hierarchical``: ``SharedOptimizer(adamw, hierarchical=True)``: a dense all-reduce inside
  each machine, one encoded message per machine across the link.

Per method: 5 warm-up steps, then up to ``--steps`` timed steps (at most 60 s); ``ms/step`` is
the median of the slowest rank's step; ``link bytes/step`` is what crossed the veth in both
directions during the timed steps, read from ``/sys/class/net/<veth>/statistics/tx_bytes`` in
each namespace before and after (IP and TCP headers included), divided by the steps.
Results go to bench/results/multinode.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
SUBNET = "10.77.0"
RDZV_PORT = 29400
METHODS = ["dense", "powersgd-4", "shared", "hierarchical"]
WARMUP = 5
BUDGET_S = 60.0
"""Most seconds of timed steps per method (at least 2 steps are timed)."""
TIMEOUT_S = 300.0
"""Most seconds per method in all (start, warm-up, timed steps); then it is killed."""


@dataclass(frozen=True)
class Node:
    """One simulated machine: its namespace, its end of the veth pair and that end's address."""

    namespace: str
    veth: str
    addr: str

    def exec(self) -> list[str]:
        """The prefix that runs a command inside this machine."""
        return ["ip", "netns", "exec", self.namespace]


def can_shape() -> str | None:
    """None if namespaces with veth pairs and tc shaping can be made here, else why not."""
    if os.geteuid() != 0:
        return "not root (network namespaces need it)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} missing (install iproute2)"
    return None


def _ip(*args: str, timeout: float = 20) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=timeout)


@contextlib.contextmanager
def two_nodes(
    rate: str = "1gbit", *, burst: str = "1mb", latency: str = "100ms"
) -> Iterator[tuple[Node, Node]]:
    """Two namespaces joined by a veth pair, each end's egress limited to ``rate``.

    Names carry a random token (``gsmn<token>a``/``b``), so concurrent runs never collide;
    both namespaces (and with them the veth pair) are deleted on exit, also after an error.
    ``rate=None`` leaves the link unshaped.
    """
    token = secrets.token_hex(3)
    nodes = tuple(
        Node(f"gsmn{token}{s}", f"gsv{token}{s}", f"{SUBNET}.{i + 1}") for i, s in enumerate("ab")
    )
    made: list[str] = []
    try:
        for node in nodes:
            _ip("netns", "add", node.namespace)
            made.append(node.namespace)
        _ip("link", "add", nodes[0].veth, "type", "veth", "peer", "name", nodes[1].veth)
        made.append(nodes[0].veth)
        for node in nodes:
            _ip("link", "set", node.veth, "netns", node.namespace)
            ns = ["-n", node.namespace]
            _ip(*ns, "link", "set", "lo", "up")
            _ip(*ns, "addr", "add", f"{node.addr}/24", "dev", node.veth)
            _ip(*ns, "link", "set", node.veth, "up")
            if rate:
                tbf = ["tc", "qdisc", "add", "dev", node.veth, "root", "tbf", "rate", rate]
                tbf += ["burst", burst, "latency", latency]
                subprocess.run(
                    [*node.exec(), *tbf], check=True, capture_output=True, text=True, timeout=20
                )
        yield nodes  # type: ignore[misc]
    finally:
        for name in made:
            if name.startswith("gsv"):  # a veth left in this namespace (moving it failed)
                subprocess.run(["ip", "link", "delete", name], capture_output=True, timeout=20)
            else:
                subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=20)


def tx_bytes(veth: str) -> int:
    """Bytes this namespace's ``veth`` has sent (read from inside the namespace)."""
    return int(Path(f"/sys/class/net/{veth}/statistics/tx_bytes").read_text())


def link_tx_bytes(node: Node) -> int:
    """:func:`tx_bytes` of ``node``'s veth, read from outside (``ip netns exec ... cat``)."""
    path = f"/sys/class/net/{node.veth}/statistics/tx_bytes"
    out = subprocess.run(
        [*node.exec(), "cat", path], check=True, capture_output=True, text=True, timeout=20
    )
    return int(out.stdout)


def torchrun_two_nodes(
    nodes: tuple[Node, Node],
    script: str | Path,
    args: Sequence[str | Path] = (),
    *,
    nproc_per_node: int = 2,
    timeout: float = 300,
    env: dict[str, str] | None = None,
) -> list[subprocess.CompletedProcess[str]]:
    """Run ``script`` with one torchrun per machine, 2 x ``nproc_per_node`` ranks in all.

    The first machine hosts the c10d rendezvous; each torchrun advertises its veth address
    (``--local-addr``) and gloo binds to its veth (``GLOO_SOCKET_IFNAME``). Both are killed,
    with their workers, if they run longer than ``timeout`` seconds (their results then have
    return code -9 and the note "timed out" in stderr).
    """
    procs = []
    logs = []
    try:
        for i, node in enumerate(nodes):
            node_env = {
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "GLOO_SOCKET_IFNAME": node.veth,
                "PYTHONPATH": str(ROOT / "src"),
                **(env or {}),
            }
            cmd = [
                *node.exec(),
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--nproc_per_node={nproc_per_node}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={nodes[0].addr}:{RDZV_PORT}",
                f"--rdzv-conf=is_host={int(i == 0)},join_timeout=60",
                f"--local-addr={node.addr}",
                "--max-restarts=0",
                str(script),
                *map(str, args),
            ]
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            logs.append((out, err))
            proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=err,
                text=True,
                env=node_env,
                cwd=ROOT,
                start_new_session=True,
            )
            procs.append(proc)
        deadline = time.monotonic() + timeout
        codes: list[int] = []
        timed_out = False
        for p in procs:
            try:
                codes.append(p.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                timed_out = True
                codes.append(-signal.SIGKILL)
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
    results = []
    for (out, err), cmd_proc, code in zip(logs, procs, codes, strict=True):
        out.seek(0), err.seek(0)
        stderr = err.read() + (f"\ntimed out after {timeout} s" if timed_out else "")
        results.append(subprocess.CompletedProcess(cmd_proc.args, code, out.read(), stderr))
        out.close(), err.close()
    return results


# ---------------------------------------------------------------------- the benchmark


def _worker(method: str, model_size: str, steps: int, out: Path) -> None:
    """One rank of one method (under torchrun in a namespace)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gradshare
    from _env import timed_steps
    from _models import adamw, gpt, lm_loss, powersgd_bytes, text, text_batch, vocab_size

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ids = text()
    net = gpt(model_size, vocab_size(ids))
    g = torch.Generator().manual_seed(rank)
    batches = [text_batch(ids, 2, 64, g) for _ in range(4)]
    run: torch.nn.Module = net
    opt = adamw(list(net.parameters()))
    if method == "dense":
        run = DDP(net)
    elif method == "powersgd-4":
        run = DDP(net, bucket_cap_mb=4096)
        state = powerSGD_hook.PowerSGDState(
            None, matrix_approximation_rank=4, start_powerSGD_iter=2
        )
        run.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    else:
        opt = gradshare.SharedOptimizer(opt, hierarchical=method == "hierarchical")
    veth = os.environ["GLOO_SOCKET_IFNAME"]
    local_leader = int(os.environ.get("LOCAL_RANK", "0")) == 0
    tx0 = [0]

    def step(i: int) -> None:
        opt.zero_grad()
        x, y = batches[i % 4]
        lm_loss(run(x), y).backward()
        opt.step()

    def at_warmup() -> None:
        tx0[0] = tx_bytes(veth) if local_leader else 0

    times = timed_steps(step, steps=steps, warmup=WARMUP, budget_s=BUDGET_S, at_warmup=at_warmup)
    dist.barrier()
    link = torch.tensor([tx_bytes(veth) - tx0[0] if local_leader else 0], dtype=torch.float64)
    dist.all_reduce(link)  # both machines' veths
    numel = sum(p.numel() for p in net.parameters())
    sent = getattr(opt, "bytes_sent", None)
    if rank == 0:
        row = {
            "method": method,
            "model": model_size,
            "numel": numel,
            "ms": statistics.median(times) * 1e3,
            "steps": len(times),
            "link_bytes_per_step": float(link) / len(times),
            "powersgd_payload": powersgd_bytes(net, 4) if method == "powersgd-4" else None,
            "rank0_message_bytes_total": sent,
        }
        out.write_text(json.dumps(row))
    dist.destroy_process_group()


def measure(nodes: tuple[Node, Node], method: str, model: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        os.chmod(tmp, 0o777)
        args = ["--worker", method, "--model", model, "--steps", str(steps), "--out", out]
        runs = torchrun_two_nodes(nodes, Path(__file__).resolve(), args, timeout=TIMEOUT_S)
        if any(r.returncode != 0 for r in runs) or not out.exists():
            tail = "\n".join(r.stderr[-1500:] for r in runs)
            print(f"{method} failed:\n{tail}", flush=True)
            return {"method": method, "model": model, "error": tail[-500:]}
        return json.loads(out.read_text())


def table(rows: list[dict]) -> str:
    head = f"{'method':<13} {'ms/step':>9} {'vs dense':>9} {'link bytes/step':>16} {'steps':>6}"
    dense = next((r["ms"] for r in rows if r["method"] == "dense" and "ms" in r), None)
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['method']:<13} failed")
            continue
        speed = f"{dense / r['ms']:.2f}x" if dense else "-"
        lines.append(
            f"{r['method']:<13} {r['ms']:>9.1f} {speed:>9} "
            f"{r['link_bytes_per_step']:>16,.0f} {r['steps']:>6}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-25m", choices=["gpt-25m", "gpt-0.45m"])
    parser.add_argument("--rate", default="1gbit", help="tc tbf rate of each veth end")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per method")
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--out", type=Path, default=RESULTS / "multinode.json")
    parser.add_argument("--worker", choices=METHODS, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        _worker(args.worker, args.model, args.steps, args.out)
        return
    why = can_shape()
    if why:
        print(f"skipped: {why}")
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _env import environment

    rows = []
    with two_nodes(args.rate) as nodes:
        for method in args.methods:
            print(f"{args.model}, {args.rate}, 2 machines x 2 ranks, {method} ...", flush=True)
            rows.append(measure(nodes, method, args.model, args.steps))
            print(table(rows[-1:]), flush=True)
    print(table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    setup = {"machines": 2, "ranks_per_machine": 2, "rate": args.rate, "warmup": WARMUP}
    saved = {"environment": environment(), "setup": setup, "rows": rows}
    args.out.write_text(json.dumps(saved, indent=1))
    print(f"\nsaved {args.out}")


if __name__ == "__main__":
    main()
