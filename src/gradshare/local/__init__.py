"""DL4J's single-process system: N workers of one process sharing encoded updates.

What lives here:

- :mod:`~gradshare.local.accumulator`: ``EncodedGradientsAccumulator`` (DL4J's), one queue
  per party, barriers, the decoded sum.
- :mod:`~gradshare.local.tail`: ``IndexedTail``, updates from other nodes with a read position
  per consumer.
- :mod:`~gradshare.local.parallel`: ``ParallelWrapper``, DL4J's "shared gradients" trainer.

May import: :mod:`gradshare.encoding`, :mod:`gradshare.codec`, ``gradshare._checks``; never
:mod:`gradshare.distributed` (no process group here).
"""
