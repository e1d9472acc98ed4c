"""Helpers private to swarm.checkpoint: a strict safetensors header check that never runs pickle.

The header is read with plain ``json`` before ``safetensors`` ever sees the bytes, so a file that
is not safetensors (a torch.save zip or a raw pickle, for instance) is refused by its first bytes.
"""

from __future__ import annotations

import json
import math
from typing import Any

from bootstrap.errors import Rejected
from swarm.checkpoint.manifest import TensorInfo

# safetensors dtype code -> (our dtype name, element size in bytes)
SAFETENSORS_DTYPES = {
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
}
_MAX_HEADER_BYTES = 16 << 20
_PICKLE_HINTS = (b"PK\x03\x04", b"\x80")  # torch.save's zip container; a raw pickle stream


class HeaderError(Rejected):
    """The bytes are not an acceptable safetensors file; ``reason`` is a ShardRejected reason."""


def not_safetensors(detail: str, data: bytes) -> HeaderError:
    hint = " (looks like torch.save/pickle output)" if data.startswith(_PICKLE_HINTS) else ""
    return HeaderError("not safetensors", f"not a safetensors file (pickle is never loaded){hint}: {detail}")


def parse_header(data: bytes) -> tuple[TensorInfo, ...]:
    """The tensors a safetensors file declares, after checking its layout; raises HeaderError.

    Checks: header length, JSON object with unique keys, allowed dtypes, sizes that match shapes,
    and data offsets that tile the data section exactly (as safetensors itself requires).
    """
    if len(data) < 8:
        raise not_safetensors(f"only {len(data)} bytes", data)
    header_len = int.from_bytes(data[:8], "little")
    if header_len < 2 or header_len > min(_MAX_HEADER_BYTES, len(data) - 8):
        raise not_safetensors(f"header length {header_len} does not fit a {len(data)}-byte file", data)
    header = _load_header_json(data[8 : 8 + header_len], data)
    data_len = len(data) - 8 - header_len
    header.pop("__metadata__", None)
    entries = sorted(((name, _entry(name, spec, data)) for name, spec in header.items()), key=lambda e: e[1][2])
    position = 0
    for name, (_, _, begin, end) in entries:
        if begin != position or end > data_len:
            raise not_safetensors(f"tensor {name!r} data offsets [{begin}, {end}] do not tile the data section", data)
        position = end
    if position != data_len:
        raise not_safetensors(f"{data_len - position} trailing bytes after the last tensor", data)
    try:
        return tuple(TensorInfo(name=name, dtype=dtype, shape=shape) for name, (dtype, shape, _, _) in entries)
    except ValueError as e:  # e.g. an empty or oversized tensor name
        raise not_safetensors(str(e), data) from None


def _load_header_json(raw: bytes, data: bytes) -> dict[str, Any]:
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        if len({k for k, _ in pairs}) != len(pairs):
            raise ValueError("duplicate key")
        return dict(pairs)

    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise not_safetensors(f"header is not JSON ({e})", data) from None
    if not isinstance(header, dict):
        raise not_safetensors("header is not a JSON object", data)
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise not_safetensors("__metadata__ must map strings to strings", data)
    return header


def _entry(name: str, spec: Any, data: bytes) -> tuple[str, tuple[int, ...], int, int]:
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise not_safetensors(f"tensor {name!r} entry must have exactly dtype, shape, data_offsets", data)
    if not isinstance(spec["dtype"], str) or spec["dtype"] not in SAFETENSORS_DTYPES:
        raise HeaderError(
            "unexpected dtype",
            f"tensor {name!r} has dtype {spec['dtype']!r:.20}; allowed: {sorted(SAFETENSORS_DTYPES)}",
        )
    dtype, item_size = SAFETENSORS_DTYPES[spec["dtype"]]
    shape, offsets = spec["shape"], spec["data_offsets"]
    if not isinstance(shape, list) or len(shape) > 16 or not all(_is_nonneg_int(d) for d in shape):
        raise not_safetensors(f"tensor {name!r} shape {shape!r:.60} is not a list of non-negative ints", data)
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_nonneg_int(o) for o in offsets):
        raise not_safetensors(f"tensor {name!r} data_offsets {offsets!r:.60} malformed", data)
    begin, end = offsets
    if end - begin != math.prod(shape) * item_size:
        raise not_safetensors(
            f"tensor {name!r} holds {end - begin} bytes, its shape needs {math.prod(shape) * item_size}", data
        )
    return dtype, tuple(shape), begin, end


def _is_nonneg_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
