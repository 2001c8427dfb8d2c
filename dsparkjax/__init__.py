"""dsparkjax: DeepSeek-V4-Flash inference with exact DSpark speculative decoding in JAX.

Public API: `load_target`, `forward`, `load_drafter`, `generate` (and the `Result` they return).
"""

from dsparkjax.decoding.forward import forward
from dsparkjax.decoding.generate import Result, generate
from dsparkjax.decoding.proposer import Drafter, load_drafter
from dsparkjax.target_api import Target, load_target

__all__ = ["Drafter", "Result", "Target", "forward", "generate", "load_drafter", "load_target"]
