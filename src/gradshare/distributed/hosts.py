"""How many ranks of a job share this host, learnt over the process group.

The codec's kernels size their threads to this process's share of the machine
(:mod:`gradshare.codec.threads`); ranks started without ``LOCAL_WORLD_SIZE`` (by
``torch.multiprocessing``, say) learn how many of them share the host here, once, when
:class:`~gradshare.SharedOptimizer`, the DDP hook or :class:`~gradshare.LocalSteps` starts.
"""

from __future__ import annotations

import hashlib
import logging
import random
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from gradshare.codec import threads
from gradshare.distributed import _inflight

__all__ = ["count_ranks_on_host", "rendezvous_port"]

logger = logging.getLogger(__name__)


def count_ranks_on_host(group: dist.ProcessGroup | None = None) -> int:
    """All-gather a host id over ``group`` and record how many of its ranks share this host.

    A collective: every rank of ``group`` must call it, so it runs whatever this rank's own
    settings are (a rank that skipped it would leave the others waiting); ``LOCAL_WORLD_SIZE``
    and an explicit thread count still take precedence over what it learns.
    """
    threads.torch_threads()  # read before anything else can touch the OpenMP runtime
    digest = hashlib.blake2b(socket.gethostname().encode(), digest_size=7).digest()
    mine = torch.tensor([int.from_bytes(digest, "little")], dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        mine = mine.cuda()
    hosts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    work = _inflight.issue(
        lambda: dist.all_gather(hosts, mine, group=group, async_op=True), (hosts, mine)
    )
    work.wait()
    del work  # the backend lets go of it before this returns (see _inflight)
    _inflight.settle((hosts, mine))
    count = sum(int(h) == int(mine) for h in hosts)
    threads.note_ranks_on_host(count)
    logger.debug(
        "%d rank(s) on this host; kernels use %d thread(s)", count, threads.kernel_threads()
    )
    return count


def rendezvous_port(host: str = "127.0.0.1") -> int:
    """A free TCP port on ``host`` for a rendezvous store (``MASTER_PORT``), below the
    ephemeral range.

    A port that ``bind((host, 0))`` hands out lies in the ephemeral range, where the kernel
    also draws the local port of every outgoing connection. Until the store listens on it, a
    rank that is already trying to connect can be given that very port as its own and connect
    to itself (TCP's simultaneous open), then wait forever for a store that is itself; any
    other process's connection can take it too. No local port is drawn below the range.
    """
    low = _ephemeral_low()
    draw = random.SystemRandom()
    for _ in range(200):
        port = draw.randrange(max(1024, low // 2), low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every draw taken: any free port, as before
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    """The first port of this host's ephemeral range (Linux's default: 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
