"""Write a GGUF file of the same model at another tensor type (Q8_0, F16, Q4_0, …) with the `gguf` package.

Every matrix is dequantized to float32 and quantized again to the type asked for; a tensor already of that type is
copied byte for byte, a 1-D tensor (the norms) stays float32 as llama.cpp's own quantizer keeps it, and a matrix
whose rows do not split into the type's blocks falls back to F16 (again llama.cpp's rule). Metadata and the
tokenizer are copied as they are, but for general.file_type, which names the new type. The header written is read
back and held to the plan (every tensor's shape, type and byte count) before the file takes its name.

Re-quantizing an already quantized file does not recover precision the file lost: a Q8_0 made from the default
model's Q4_1 file is a Q8_0 of the Q4_1 weights (their float32 values), which is what a comparison of the two needs.

    python -m engine.formats.requantize SRC.gguf DST.gguf --type Q8_0
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np

# The types the gguf package can quantize to, and the general.file_type each file is then (gguf.LlamaFileType).
FILE_TYPES = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q8_0": "MOSTLY_Q8_0",
              "Q5_1": "MOSTLY_Q5_1", "Q5_0": "MOSTLY_Q5_0", "Q4_1": "MOSTLY_Q4_1", "Q4_0": "MOSTLY_Q4_0"}
SKIPPED_KEYS = ("general.architecture", "general.file_type", "general.alignment")  # the writer writes these itself


def _plan(reader, target) -> list[tuple[object, object, tuple[int, ...]]]:
    """(source tensor, type to write, numpy shape) for every tensor, in the file's order."""
    import gguf

    T = gguf.GGMLQuantizationType
    out = []
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))  # numpy order: (rows, row length)
        block = gguf.GGML_QUANT_SIZES[target][0]
        if len(shape) < 2:
            kind = T.F32
        elif shape[-1] % block == 0:
            kind = target
        else:
            kind = T.F32 if target == T.F32 else T.F16
        out.append((t, kind, shape))
    return out


def _nbytes(kind, shape: tuple[int, ...]) -> int:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[kind]
    return int(np.prod(shape[:-1], dtype=np.int64)) * shape[-1] // block * size


def _convert(t, kind, shape: tuple[int, ...]) -> np.ndarray:
    """The tensor's data at `kind`: its own bytes when it already is, else dequantized and quantized again."""
    import gguf

    if t.tensor_type == kind:
        return np.ascontiguousarray(t.data)
    values = np.asarray(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float32).reshape(shape)
    return np.ascontiguousarray(gguf.quants.quantize(values, kind))


def requantize(src: str | os.PathLike, dst: str | os.PathLike, qtype: str = "Q8_0",
               progress: Callable[[float, str], None] | None = None) -> dict:
    """Write `src` at tensor type `qtype` to `dst`; returns {"path", "type", "bytes", "tensors_by_type"}.

    ValueError (one sentence) for a type the gguf package cannot write, a file it cannot read, or a written header
    that does not match the plan (then `dst` is not left behind).
    """
    import gguf

    if qtype not in FILE_TYPES:
        raise ValueError(f"cannot write tensor type {qtype!r}: choose among {', '.join(FILE_TYPES)}")
    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise ValueError(f"{dst.name} is the file being read: write the new one elsewhere")
    target = gguf.GGMLQuantizationType[qtype]
    try:
        reader = gguf.GGUFReader(src)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {src.name} as GGUF: {e}") from None
    arch = reader.get_field("general.architecture")
    if arch is None:
        raise ValueError(f"{src.name} names no architecture (general.architecture)")
    plan = _plan(reader, target)
    tmp = dst.with_name(dst.name + ".partial")
    writer = gguf.GGUFWriter(tmp, str(arch.contents()), endianess=reader.endianess)
    try:
        for field in reader.fields.values():
            if field.name.startswith("GGUF.") or field.name in SKIPPED_KEYS:
                continue
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
        writer.add_file_type(gguf.LlamaFileType[FILE_TYPES[qtype]])
        for t, kind, shape in plan:
            raw = shape if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) else \
                gguf.quants.quant_shape_to_byte_shape(shape, kind)
            dtype = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}.get(
                kind, np.uint8)
            writer.add_tensor_info(t.name, raw, np.dtype(dtype), _nbytes(kind, shape), raw_dtype=kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for i, (t, kind, shape) in enumerate(plan):  # one tensor in memory at a time
            writer.write_tensor_data(_convert(t, kind, shape), tensor_endianess=reader.endianess)
            if progress is not None:
                progress((i + 1) / len(plan), f"{t.name} → {kind.name}")
        writer.close()
        _check(tmp, plan)
        tmp.replace(dst)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    counts = Counter(kind.name for _, kind, _ in plan)
    return {"path": str(dst), "type": qtype, "bytes": dst.stat().st_size, "tensors_by_type": dict(counts)}


def _check(path: Path, plan: list) -> None:
    """The written header read back: the same tensors, each at its planned type, shape and byte count."""
    import gguf

    got = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for t, kind, shape in plan:
        w = got.get(t.name)
        if w is None:
            raise ValueError(f"the written file lacks tensor {t.name}")
        w_shape = tuple(int(n) for n in reversed(w.shape))
        if w.tensor_type != kind or w_shape != shape or int(w.n_bytes) != _nbytes(kind, shape):
            raise ValueError(f"the written {t.name} is {w.tensor_type.name} {w_shape} in {w.n_bytes} bytes; the plan "
                             f"was {kind.name} {shape} in {_nbytes(kind, shape)}")
    if len(got) != len(plan):
        raise ValueError(f"the written file has {len(got)} tensors, the source {len(plan)}")


def main(argv: list[str] | None = None) -> int:
    from engine.cliargs import Parser, output_file
    from engine.formats.locate import ModelLoadError, resolve_model_path

    p = Parser(prog="python -m engine.formats.requantize",
               description="Write a GGUF file of the same model at another tensor type.")
    p.add_argument("src", help="a .gguf file or a known model's name (smollm2, gemma3-270m)")
    p.add_argument("dst", type=output_file, help="the .gguf file to write")
    p.add_argument("--type", default="Q8_0", choices=list(FILE_TYPES))
    a = p.parse_args(argv)
    try:
        out = requantize(resolve_model_path(a.src), a.dst, a.type)
    except (ModelLoadError, ValueError, OSError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    print(f"{out['path']}: {out['type']}, {out['bytes']:,} bytes, tensors {out['tensors_by_type']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
