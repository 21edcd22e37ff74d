"""Local steps with sparse, error-feedback syncs: DiLoCo / SparseLoCo on gradshare's codec.

Each rank holds a full replica of the model and trains it alone with its own (inner)
optimizer for ``sync_every`` steps (H); then every rank sends how far its replica moved from
the shared *global copy*, threshold-encoded with error feedback, and every rank applies the
same averaged move to the global copy with an outer optimizer and starts again from it
(Douillard et al. 2023, DiLoCo; SparseLoCo: top-k with error feedback on that move). The
user's loop is unchanged: the sync runs in a step post-hook of the inner optimizer.

A sync, on every rank:

1. Δ = global - local, per parameter (the *outer gradient*: how far the replica moved);
   every rank tells the others (a small int64 header) its round, whether its Δ is finite and
   its buffers' digests; a difference, or a non-finite Δ anywhere, raises the same error on
   every rank before anything changes;
2. residual = β·residual + Δ (β = ``decay``; β = 1 is DL4J's residual);
3. the residual is threshold-encoded (one :class:`~gradshare.Encoder` per parameter,
   :class:`~gradshare.QuantileThreshold` of ``density`` by default; sparse indices, or a
   bitmap when too many cross; in the compact form by default): what is sent leaves the
   residual, the rest waits. Every parameter sends 2 entries a sync at least (DL4J's
   messages carry no fewer), so the biases and norms of narrow layers train too; a
   1-element parameter (or, under another ``threshold`` algorithm, one too small for its
   messages: :func:`~gradshare.encoding.threshold.sends_whole`) sends all of its residual, a
   dense piece of float32 values;
4. every rank's message (its parameters' pieces back to back) is all-gathered;
5. every piece is validated whole, and the pieces are decoded in rank order into their sum,
   divided by the world size: the average outer gradient, alike on every rank;
6. the outer optimizer steps the global copy with that average as its gradient (a step that
   turns it non-finite raises, naming the outer optimizer, and syncing stops);
7. the global copy is copied into the model: the replicas' parameters are bit-identical after
   a sync; so are their buffers (BatchNorm's statistics: rank 0's, as DDP does, sent only
   where the digests differ; ``broadcast_buffers``). Each rank's inner optimizer state stays
   its own.

On the CPU the steps run in few passes over the model: per parameter, one pass computes Δ,
decays it into the residual (beside the old one, with one fragment: the two swap) and samples
the new residual for its threshold, and step 3 follows at once, while it is in cache (the
header of step 1 comes after them; a refused round puts every residual and encoder back);
with plain SGD as the outer optimizer (the default, :mod:`.outer`), steps 5-6 touch only the
elements the pieces name, and step 7 is one copy.

With ``dense=True`` (or ``density=1.0``) steps 2-5 are an exact float32 all-reduce of Δ
(DiLoCo); with ``outer_optimizer=lambda p: torch.optim.SGD(p, lr=1.0)`` a dense sync leaves
every replica at the mean of the ranks' replicas.

**Fragments** (``fragments=P``, Streaming DiLoCo): the parameters are cut into P runs of
about equal size, and fragment f goes through steps 1-7 alone, at the steps ≡ f·H/P (mod
H); the other parameters are left as they are. Each exchange carries 1/P of the bytes; a
fragment is bit-identical on every rank right after its own sync (or merge).

**Overlap** (``overlap=τ``, an int in [1, H]; ``True`` is H): the exchange runs in a
background thread while the ranks take their next τ inner steps. At sync k every rank
exchanges the header (step 1, synchronously), encodes Δ_k (steps 2-3), launches its exchange
(step 4) and goes on training. After the τ-th step that follows, it waits for the exchange,
takes the outer step with its mean (steps 5-6) and the model takes the global copy (step 7):
the replicas are bit-identical after every merge. What each replica moved during those τ
steps stays this rank's own *carry* (where the round was sent from, noted by its Δ pass, less
the replica at the merge, in the pass that gives the model the global copy), and the next Δ
is measured from the global copy plus the carry. With τ = H the merge comes at the next
sync, just after Δ_k+1 is taken, and the model takes the global copy plus that outer step
again (a *lead*, the same on every rank, standing in for the round now in flight).
``flush()`` merges the round in flight at once, keeping this replica's moves since its send
and its carry; ``close()`` and leaving the ``with`` block flush; ``state_dict()`` waits for
the round and saves its mean. A failed background exchange raises at the next merge, sync,
flush, close or save, with every encoder put back as it was before that round and the
round's moves kept for the next sync.

The laws the tests hold it to (tests/test_local_steps.py): per parameter and rank, with β = 1,
Σ Δ = Σ decoded own messages + residual (conservation), and with β < 1, residual_k =
β·residual_(k-1) + Δ_k - decoded own message_k (decay); a dense sync with outer SGD lr 1 is
the mean of the replicas, and the overlapped and fragmented runs are their recurrences, bit
for bit.

What lives here:

- :mod:`.core`: :class:`LocalSteps`, which validates, builds the fragments, hooks the inner
  optimizer, counts and runs each round's steps in order;
- :mod:`.options`: :class:`LocalStepsOptions` and the defaults, declared once;
- :mod:`.schedule`: which fragment syncs and when a merge is, at step s (pure arithmetic);
- :mod:`.fragment`: a fragment's views of every buffer and the arithmetic of a round;
- :mod:`.outer`: which outer steps LocalSteps takes itself (plain SGD, found exactly);
- :mod:`.agreement`: :class:`AgreementSGD`, an outer optimizer to try on many ranks under an
  adaptive inner optimizer (the mean mapped by the ranks' agreement);
- :mod:`.protocol`: the round's collectives (header, status, dense or encoded mean);
- :mod:`.overlap`: the round in flight, the carry, the lead, the flush;
- :mod:`.state`: the checkpoint (save, load, migrations from earlier formats);
  :mod:`.resize`: a state saved at another world size, loaded at a restart;
- :mod:`.elastic`: :class:`Elastic`, training on when ranks fail, leave or join (torchft).
"""

from gradshare.distributed.local_steps.agreement import AgreementSGD
from gradshare.distributed.local_steps.core import LocalSteps
from gradshare.distributed.local_steps.elastic import Elastic
from gradshare.distributed.local_steps.options import (
    DEFAULT_DECAY,
    DEFAULT_DENSITY,
    DEFAULT_OUTER_LR,
    DEFAULT_OUTER_LR_SGD,
    DEFAULT_SYNC_EVERY,
    LocalStepsOptions,
    default_outer_lr,
)

__all__ = [
    "AgreementSGD",
    "DEFAULT_DECAY",
    "DEFAULT_DENSITY",
    "DEFAULT_OUTER_LR",
    "DEFAULT_OUTER_LR_SGD",
    "DEFAULT_SYNC_EVERY",
    "Elastic",
    "LocalSteps",
    "LocalStepsOptions",
    "default_outer_lr",
]
