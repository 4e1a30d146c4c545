"""The blockwise twin: portable pure-JAX FlashAttention, the CPU default and
the kernels' numerics twin (forward, backward, FP8 and decode), and its
backend (`backend.py`). docs/api.md#backends
"""

from pallas_fa3.backends.blockwise.backend import BACKEND as BACKEND
from pallas_fa3.backends.blockwise.backward import (
  blockwise_backward as blockwise_backward,
)
from pallas_fa3.backends.blockwise.decode import (
  blockwise_decode as blockwise_decode,
)
from pallas_fa3.backends.blockwise.forward import (
  blockwise_forward as blockwise_forward,
)
from pallas_fa3.backends.blockwise.fp8 import (
  blockwise_forward_fp8 as blockwise_forward_fp8,
)
from pallas_fa3.backends.blockwise.tiles import (
  BlockwiseConfig as BlockwiseConfig,
)
