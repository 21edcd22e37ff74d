"""gradshare: threshold-encoded, error-feedback update sharing for data-parallel PyTorch.

The Python home of Deeplearning4j's ``EncodedGradientsAccumulator`` (after Strom, 2015): each
worker keeps a residual, sends only the entries that crossed a threshold (as signed indices, or a
2-bit bitmap when too many crossed), the threshold adapts to hold a target density, and every
replica applies the same decoded sum.

The package, in the order an update flows (imports run one way: codec <- encoding <- local,
distributed <- integrations, app):

- :mod:`gradshare.codec`: DL4J's wire format and its kernels;
- :mod:`gradshare.encoding`: one worker's encoder, the threshold algorithms, ``EncodingOptions``;
- :mod:`gradshare.local`: DL4J's single-process system (accumulator, IndexedTail,
  ParallelWrapper);
- :mod:`gradshare.distributed`: over torch.distributed (exchange, SharedOptimizer, the DDP
  hook, nodes);
- :mod:`gradshare.integrations`: Lightning, accelerate, per-rank checkpoint files (imported on
  demand, never by ``import gradshare``);
- :mod:`gradshare.app`: ``gradshare train / bench / inspect`` and the report.

Importing gradshare starts nothing: no CUDA, no numba compilation, no process group.
"""

from gradshare import _moved
from gradshare.codec import (
    BITMAP_ENCODING,
    COMPACT_ENCODING,
    DENSE_ENCODING,
    FLEXIBLE_ENCODING,
    MessageError,
    MessageInfo,
    compact_message,
    decode_,
    encode_bitmap_,
    encode_dense_,
    encode_sparse_,
    expand_message,
    message_info,
)
from gradshare.distributed.ddp_hook import (
    ThresholdHookState,
    register_threshold_hook,
    threshold_hook,
)
from gradshare.distributed.exchange import ExchangeError, exchange_messages
from gradshare.distributed.local_steps import (
    AgreementSGD,
    Elastic,
    LocalSteps,
    LocalStepsOptions,
)
from gradshare.distributed.shared_optimizer import SharedOptimizer
from gradshare.encoding.encoder import Encoder, EncodeStats
from gradshare.encoding.options import EncodingOptions
from gradshare.encoding.residual import (
    NoResidualProcessing,
    ResidualClipping,
    ResidualPostProcessor,
)
from gradshare.encoding.threshold import (
    AdaptiveThreshold,
    FixedThreshold,
    QuantileThreshold,
    TargetDensityThreshold,
    ThresholdAlgorithm,
)
from gradshare.local.accumulator import (
    AccumulatorError,
    EncodedGradientsAccumulator,
    optimal_buffer_size,
)
from gradshare.local.parallel import ParallelWrapper, StepStats
from gradshare.local.tail import IndexedTail

__version__ = "0.1.0"

_moved.install()  # the 0.1 module paths, for one release (see gradshare._moved)

__all__ = [
    "AgreementSGD",
    # wire format
    "BITMAP_ENCODING",
    "COMPACT_ENCODING",
    "DENSE_ENCODING",
    "FLEXIBLE_ENCODING",
    "MessageError",
    "MessageInfo",
    "compact_message",
    "decode_",
    "encode_bitmap_",
    "encode_dense_",
    "encode_sparse_",
    "expand_message",
    "message_info",
    # one worker
    "EncodeStats",
    "Encoder",
    "EncodingOptions",
    # threshold algorithms
    "AdaptiveThreshold",
    "FixedThreshold",
    "QuantileThreshold",
    "TargetDensityThreshold",
    "ThresholdAlgorithm",
    # residual post-processing
    "NoResidualProcessing",
    "ResidualClipping",
    "ResidualPostProcessor",
    # N local parties
    "AccumulatorError",
    "EncodedGradientsAccumulator",
    "IndexedTail",
    "optimal_buffer_size",
    # the local multi-worker trainer
    "ParallelWrapper",
    "StepStats",
    # across processes: torch.distributed
    "Elastic",
    "ExchangeError",
    "LocalSteps",
    "LocalStepsOptions",
    "SharedOptimizer",
    "exchange_messages",
    # for DDP users
    "ThresholdHookState",
    "register_threshold_hook",
    "threshold_hook",
]
