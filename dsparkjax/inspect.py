"""Validate a target (and optionally a drafter) GGUF without loading weights, and describe it.

    python -m dsparkjax.inspect TARGET [--draft DRAFT] [--check_bytes]

Checks the whole contract of each file (metadata, tensor table, the drafter's fit to the target; with
`--check_bytes` also every tensor's bytes: ROCm scale bytes, NaN/inf values and block scales) and prints
the config, the tensor count, the bytes per tensor family, the quant recipe actually found (family -> ggml
types) and the quantized types whose matrices stay packed on the kernels under kernels="ffi"/"reference".
On a contract violation it prints the error message and exits with status 1.
"""

from __future__ import annotations

import dataclasses
import sys

from dsparkjax import formats
from dsparkjax.errors import DsparkError
from dsparkjax.ggufio.contract import (
    check_tensor_bytes,
    drafter_tensor_specs,
    open_drafter,
    open_target,
    target_tensor_specs,
)
from dsparkjax.ggufio.reader import GGUFFile
from dsparkjax.ggufio.writer import QUANT_RECIPE_KEY
from dsparkjax.kernels.packed import KERNEL_TYPES


def _describe_file(kind: str, file: GGUFFile, cfg, specs, check_bytes: bool) -> list[str]:
    family = {s.name: s.family for s in specs}
    lines = [f"{kind}: {file.path}", f"  architecture: {file.architecture}"]
    lines.append(f"  config ({type(cfg).__name__}):")
    lines += [f"    {f.name}: {getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)]
    total = sum(info.nbytes for info in file.tensors.values())
    lines.append(f"  tensors: {len(file.tensors)} ({total} bytes)")
    nbytes: dict[str, int] = {}
    types: dict[str, set[str]] = {}
    for info in file.tensors.values():
        fam = family[info.name]
        nbytes[fam] = nbytes.get(fam, 0) + info.nbytes
        types.setdefault(fam, set()).add(info.type_name)
    order = list(dict.fromkeys(s.family for s in specs if s.family in nbytes))
    lines.append("  bytes per family:")
    lines += [f"    {fam}: {nbytes[fam]}" for fam in order]
    recipe = file.metadata.get(QUANT_RECIPE_KEY)
    lines.append("  quant recipe (family -> ggml types found)" + (f", written as {recipe!r}:" if recipe else ":"))
    lines += [f"    {fam}: {', '.join(sorted(types[fam]))}" for fam in order]
    lines.append(_kernel_line(file))
    if check_bytes:
        for info in file.tensors.values():
            check_tensor_bytes(file.path, info, file.raw(info.name))
            file.release(info.name)
        lines.append(f"  tensor bytes: {len(file.tensors)} tensor(s) checked: ROCm scale bytes valid, "
                     "no NaN or inf values or block scales")
    return lines


def _kernel_line(file: GGUFFile) -> str:
    """The file's quantized types (bytes stored) that the packed kernels take: its matrices of these types
    stay packed under kernels="ffi"/"reference"."""
    dense = {formats.type_name(t) for t in formats.FLOAT_TYPES | formats.INTEGER_TYPES}
    kernel_names = {formats.type_name(t) for t in KERNEL_TYPES}
    stored = {name: n for name, n in file.bytes_by_type().items() if name in kernel_names - dense}
    listing = ", ".join(f"{name} ({stored[name]} bytes)" for name in sorted(stored)) or "none"
    return f"  packed on the kernels (kernels=ffi/reference): {listing}"


def describe(path: str, draft: str | None = None, check_bytes: bool = False) -> str:
    """Check a target GGUF (and a drafter against it) and return a description; raises GGUFContractError."""
    file, cfg = open_target(path)
    lines = _describe_file("target", file, cfg, target_tensor_specs(cfg), check_bytes)
    if draft is not None:
        dfile, dcfg = open_drafter(draft, cfg)
        lines += _describe_file("drafter", dfile, dcfg, drafter_tensor_specs(dcfg), check_bytes)
        lines.append("drafter fits the target: yes")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    from absl import flags

    if len(argv) != 2:
        print(f"usage: python -m dsparkjax.inspect TARGET [--draft DRAFT] [--check_bytes]; got {argv[1:]}",
              file=sys.stderr)
        sys.exit(2)
    try:
        print(describe(argv[1], flags.FLAGS.draft, flags.FLAGS.check_bytes))
    except DsparkError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    from absl import app, flags

    # Defined only when run as a program, so importing this module never clashes with other flag owners.
    flags.DEFINE_string("draft", None, "A drafter GGUF to check against the target.")
    flags.DEFINE_bool("check_bytes", False,
                      "Also scan every tensor's bytes: ROCm scale bytes, NaN/inf values and block scales.")
    app.run(main)
