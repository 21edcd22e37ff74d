"""The wire format: DL4J's threshold-encoded messages, their validation, and the kernels.

What lives here:

- :mod:`~gradshare.codec.messages`: encode a residual in place into an int32 message (sparse
  signed indices, or DL4J's 2-bit bitmap), validate a message whole, decode (adding) into a
  target; ``MessageError``. Byte-compatible with DL4J (docs/wire-format.md).
- :mod:`~gradshare.codec.compact_form`: the compact form of a sparse message (a byte per
  entry, an option; lossless), made by ``compact_message`` and read back by
  ``expand_message`` and every decoder.
- :mod:`~gradshare.codec.multipart`: several vectors' messages sent back to back as one.
- ``encode_dense_``: a dense piece (format 3, gradshare's own), the float32 values
  themselves, for a vector too small for a threshold message.
- :mod:`~gradshare.codec.flat`: the slices of one flat vector that hold many tensors (every
  multi-tensor front end cuts its buffers with it).
- private: ``_format`` (layout constants), ``_workspace`` (the encode workspace),
  ``_dispatch`` (kernel or torch path), ``_kernels`` / ``_intrinsics`` (numba, compiled on
  first use), ``_torch_paths`` (the same steps as torch ops); :mod:`~gradshare.codec.threads`
  sizes the kernels' threads.

May import: torch, numpy, numba, and ``gradshare._checks``; nothing else of gradshare.
Importing it starts nothing (numba loads at the first kernel call).
"""

from gradshare.codec.compact_form import compact_length, compact_message, expand_message
from gradshare.codec.messages import (
    BITMAP_ENCODING,
    COMPACT_ENCODING,
    DENSE_ENCODING,
    FLEXIBLE_ENCODING,
    HEADER_WORDS,
    MAGNITUDES,
    MAX_NUMEL,
    MessageError,
    MessageInfo,
    bitmap_length,
    check_message,
    decode_,
    decode_sum_,
    dense_length,
    encode_bitmap_,
    encode_dense_,
    encode_sparse_,
    kernels_enabled,
    mean_magnitude,
    message_info,
    sparse_length,
    subtract_sum_,
    take_update_,
    use_kernels,
)
from gradshare.codec.messages import (
    NonFiniteUpdate as NonFiniteUpdate,
)
from gradshare.codec.messages import (
    Workspace as Workspace,
)
from gradshare.codec.messages import (
    check_boundary as check_boundary,
)
from gradshare.codec.messages import (
    check_magnitude as check_magnitude,
)
from gradshare.codec.messages import (
    check_vector as check_vector,
)
from gradshare.codec.messages import (
    decay_add_ as decay_add_,
)
from gradshare.codec.messages import (
    decay_into_ as decay_into_,
)
from gradshare.codec.messages import (
    find_nonfinite as find_nonfinite,
)
from gradshare.codec.messages import (
    float32_threshold as float32_threshold,
)
from gradshare.codec.messages import (
    nonfinite_error as nonfinite_error,
)
from gradshare.codec.messages import (
    serial_kernels as serial_kernels,
)
from gradshare.codec.messages import (
    shares_memory as shares_memory,
)
from gradshare.codec.messages import (
    step_sum_ as step_sum_,
)
from gradshare.codec.messages import (
    subtract_ as subtract_,
)

__all__ = [
    "BITMAP_ENCODING",
    "COMPACT_ENCODING",
    "DENSE_ENCODING",
    "FLEXIBLE_ENCODING",
    "HEADER_WORDS",
    "MAGNITUDES",
    "MAX_NUMEL",
    "MessageError",
    "MessageInfo",
    "bitmap_length",
    "check_message",
    "compact_length",
    "compact_message",
    "decode_",
    "decode_sum_",
    "dense_length",
    "encode_bitmap_",
    "encode_dense_",
    "encode_sparse_",
    "expand_message",
    "kernels_enabled",
    "mean_magnitude",
    "message_info",
    "sparse_length",
    "subtract_sum_",
    "take_update_",
    "use_kernels",
]
# Also here, for gradshare's own modules (not public API): Workspace, serial_kernels, the
# check_* helpers, float32_threshold, shares_memory, find_nonfinite, nonfinite_error and its
# NonFiniteUpdate, subtract_, decay_add_, decay_into_ and step_sum_ (LocalSteps' fused passes).
