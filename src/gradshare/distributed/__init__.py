"""Sharing across processes over torch.distributed (gloo on CPU, NCCL on CUDA).

What lives here:

- :mod:`~gradshare.distributed.exchange`: the all-gather of every rank's int32 message (sizes
  first, nothing pickled), the private groups with gradshare's timeout, the ordered pipeline.
- :mod:`~gradshare.distributed.shared_optimizer`: ``SharedOptimizer``, every rank's optimizer
  update encoded and shared (DL4J's mode), flat or hierarchical (:mod:`.nodes`); its
  optimizer-API glue in :mod:`.wrapper`.
- :mod:`~gradshare.distributed.agreement`: the one check that every rank runs with the same
  settings (one readable error, the same on every rank); :mod:`.checkpoint`: what every
  per-rank state records and the checks a load runs before anything changes.
- :mod:`~gradshare.distributed.ddp_hook`: the DDP communication hook that encodes gradients.
- :mod:`~gradshare.distributed.local_steps`: ``LocalSteps``, local steps with sparse syncs
  (DiLoCo / SparseLoCo), a package of its own (options, schedule, fragments, protocol,
  overlap, state).
- :mod:`~gradshare.distributed.buffers`: a model's buffers made rank 0's on every rank.
- :mod:`~gradshare.distributed.hosts`, ``_inflight``: ranks per host; collectives in flight at
  exit.

May import: :mod:`gradshare.encoding`, :mod:`gradshare.codec`, ``gradshare._checks``; never
:mod:`gradshare.local`, :mod:`gradshare.integrations` or :mod:`gradshare.app`.
"""

from gradshare.distributed.shared_optimizer import SharedOptimizer

__all__ = ["SharedOptimizer"]
