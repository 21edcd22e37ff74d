"""How many ranks of a job share this host, learnt over the process group.

The codec's kernels size their threads to this process's share of the machine
(:mod:`gradshare.codec.threads`); ranks started without ``LOCAL_WORLD_SIZE`` (by
``torch.multiprocessing``, say) learn how many of them share the host here, once, when
:class:`~gradshare.SharedOptimizer`, the DDP hook or :class:`~gradshare.LocalSteps` starts.
"""

from __future__ import annotations

import hashlib
import logging
import socket
from typing import Any

import torch
import torch.distributed as dist

from gradshare.codec import threads
from gradshare.distributed import _inflight

__all__ = ["count_ranks_on_host"]

logger = logging.getLogger(__name__)


def count_ranks_on_host(group: Any = None) -> int:
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
    _inflight.issue(lambda: dist.all_gather(hosts, mine, group=group, async_op=True),
                    (hosts, mine)).wait()  # fmt: skip
    count = sum(int(h) == int(mine) for h in hosts)
    threads.note_ranks_on_host(count)
    logger.debug(
        "%d rank(s) on this host; kernels use %d thread(s)", count, threads.kernel_threads()
    )
    return count
