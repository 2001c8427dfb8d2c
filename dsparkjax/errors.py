"""Error types of dsparkjax.

Every failure that comes from bad input (a GGUF file, a tensor, a token id, a flag) raises one of these,
with a message naming the file, the tensor or key, what was expected and what was found.
"""

from __future__ import annotations


class DsparkError(Exception):
    """Base class of every error dsparkjax raises on purpose."""


class GGUFContractError(DsparkError):
    """A GGUF file breaks the target or drafter contract (metadata, tensors, shapes, types, bytes)."""

    def __init__(self, path: str, what: str, expected: str, found: str):
        self.path, self.what, self.expected, self.found = str(path), what, expected, found
        super().__init__(f"{self.path}: {what}: expected {expected}, found {found}")


class IncompatibleDrafterError(GGUFContractError):
    """A drafter GGUF does not fit the target it is loaded against."""


class MemoryBudgetError(DsparkError):
    """A size from a file's metadata or an argument (a window, a context length, a dense copy of a packed
    format) that would need more memory than the device or host has: refused before anything is allocated,
    naming the key and the bytes needed and available."""

    def __init__(self, source: str, key: str, needed: int, available: int, where: str):
        self.source, self.key, self.needed, self.available = str(source), key, needed, available
        super().__init__(f"{self.source}: {key}: needs {needed / 1e9:.3g} GB, but {available / 1e9:.3g} GB "
                         f"{where}")


class FormatError(DsparkError):
    """Bytes or values that a weight format cannot encode or decode (bad length, invalid scale byte)."""


class TokenIdError(DsparkError):
    """A token id outside the vocabulary or the hash-routing table."""


class UnsupportedTypeError(DsparkError):
    """A ggml type that this operation does not support."""


class DeviceMemoryError(DsparkError):
    """Weights or a decode state that cannot fit the device memory JAX may use."""


class ArgumentError(DsparkError, ValueError):
    """A call's argument of the wrong type or out of its range (named in the message)."""


class CapacityError(DsparkError):
    """A step that does not fit the decode state it runs on: wider than its rings or past its length."""
