"""One worker's encoder: the residual, the threshold algorithms, and the options they share.

What lives here:

- :mod:`~gradshare.encoding.encoder`: ``Encoder`` (DL4J's ``EncodingHandler``): residual +
  threshold + format choice + stats, one per worker (or per parameter tensor).
- :mod:`~gradshare.encoding.threshold`: DL4J's threshold algorithms (adaptive, target
  density, fixed) and the quantile rule.
- :mod:`~gradshare.encoding.residual`: residual post-processing (DL4J's clipping).
- :mod:`~gradshare.encoding.options`: ``EncodingOptions``, the encoding settings every front
  end (hook, SharedOptimizer, accumulator, ParallelWrapper, Lightning) declares once.

May import: :mod:`gradshare.codec` and ``gradshare._checks``.
"""
