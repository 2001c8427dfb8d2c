"""GGUF input and output: the memory-mapped reader, the target/drafter contracts and the writer."""

from dsparkjax.ggufio.contract import (
    FAMILY_TYPES,
    TensorSpec,
    check_tensor_bytes,
    drafter_tensor_specs,
    open_drafter,
    open_target,
    target_tensor_specs,
)
from dsparkjax.ggufio.reader import GGUFFile, TensorInfo, open_gguf
from dsparkjax.ggufio.writer import RECIPES, RawTensor, encode, write_model_gguf, write_raw_gguf

__all__ = [
    "FAMILY_TYPES", "GGUFFile", "RECIPES", "RawTensor", "TensorInfo", "TensorSpec", "check_tensor_bytes",
    "drafter_tensor_specs", "encode", "open_drafter", "open_gguf", "open_target", "target_tensor_specs",
    "write_model_gguf", "write_raw_gguf",
]
