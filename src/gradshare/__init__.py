"""gradshare: threshold-encoded, error-feedback update sharing for data-parallel PyTorch.

The Python home of Deeplearning4j's ``EncodedGradientsAccumulator`` (after Strom, 2015): each
worker keeps a residual, sends only the entries that crossed a threshold (as signed indices, or a
2-bit bitmap when too many crossed), the threshold adapts to hold a target density, and every
replica applies the same decoded sum.

Importing gradshare starts nothing: no CUDA, no numba compilation, no process group.
"""

from gradshare.accumulator import (
    AccumulatorError,
    EncodedGradientsAccumulator,
    optimal_buffer_size,
)
from gradshare.codec import (
    BITMAP_ENCODING,
    FLEXIBLE_ENCODING,
    MessageError,
    MessageInfo,
    decode_,
    encode_bitmap_,
    encode_sparse_,
    message_info,
)
from gradshare.ddp_hook import ThresholdHookState, register_threshold_hook, threshold_hook
from gradshare.distributed import SharedOptimizer
from gradshare.encoder import Encoder, EncodeStats
from gradshare.exchange import ExchangeError, exchange_messages
from gradshare.local_steps import LocalSteps
from gradshare.parallel import ParallelWrapper, StepStats
from gradshare.residual import NoResidualProcessing, ResidualClipping, ResidualPostProcessor
from gradshare.tail import IndexedTail
from gradshare.threshold import (
    AdaptiveThreshold,
    FixedThreshold,
    QuantileThreshold,
    TargetDensityThreshold,
    ThresholdAlgorithm,
)

__version__ = "0.1.0"

__all__ = [
    # wire format
    "BITMAP_ENCODING",
    "FLEXIBLE_ENCODING",
    "MessageError",
    "MessageInfo",
    "decode_",
    "encode_bitmap_",
    "encode_sparse_",
    "message_info",
    # one worker
    "EncodeStats",
    "Encoder",
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
    "ExchangeError",
    "LocalSteps",
    "SharedOptimizer",
    "exchange_messages",
    # for DDP users
    "ThresholdHookState",
    "register_threshold_hook",
    "threshold_hook",
]
