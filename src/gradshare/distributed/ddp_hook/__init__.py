"""A DDP communication hook that shares threshold-encoded gradients with error feedback.

For users who already train with ``DistributedDataParallel``: register the hook and DDP's
all-reduce of each gradient bucket becomes an exchange of threshold-encoded messages (Strom,
2015). Unlike :class:`~gradshare.SharedOptimizer`, what is encoded is the gradient, not the
optimizer's update, and the hook returns the mean of the decoded gradients, as DDP expects.

All state is per parameter: each parameter has its own residual and its own copy of the
threshold algorithm (one threshold per parameter tensor), and, with DGC's momentum correction
(Lin et al., 2018), its own velocity. A bucket is only the list of parameters that travel
together: one message per bucket and rank, the concatenation of its parameters' messages. So
DDP's bucket rebuild after the first iteration changes nothing, and a run resumed from a
checkpoint on a fresh DDP (whose first iteration has another layout) continues bit for bit.

The exchange overlaps with backward, as DDP's own all-reduce does: the hook hands each bucket
to a background :class:`~gradshare.distributed.exchange.Pipeline` and returns at once; the pipeline
encodes, exchanges and decodes the buckets one after the other, in the order they became
ready, over a private twin of the process group (so that its collectives never interleave
with the ones DDP itself issues from the backward thread).

The parts: :mod:`.state` (``ThresholdHookState``: settings, stats, checkpoints),
:mod:`.parameters` (each parameter's encoder and velocity), :mod:`.hook` (the hook and what
its pipeline runs for each bucket).
"""

from gradshare.distributed.ddp_hook.hook import register_threshold_hook, threshold_hook
from gradshare.distributed.ddp_hook.state import ThresholdHookState

__all__ = ["ThresholdHookState", "register_threshold_hook", "threshold_hook"]
