"""Wire codecs for averaging: a 1-D float32 CPU vector to bytes and back, with a stated error bound.

Every codec (:class:`Codec`) has a ``name``, ``encode``, ``decode``, an exact ``wire_bytes(numel)``
and an elementwise ``error_bound``; :func:`get_codec` builds one by name. The vector length is agreed
out of band (each slice of a butterfly all-reduce has a known size), so ``decode`` takes ``numel``
and checks the message against it before reading anything.

Received bytes are untrusted. ``decode`` never unpickles, and raises :class:`ValueError` naming the
problem for a wrong length, a bad header field or a non-finite value; its output is always a finite
1-D float32 tensor of ``numel`` elements. ``encode`` refuses non-finite input for the same reason:
a finite vector is part of every codec's contract.

Codecs and their bounds on ``|decode(encode(x)) - x|``:

* ``fp32``: raw little-endian float32, exact. ``4 * numel`` bytes.
* ``fp16``: little-endian float16, ``2 * numel`` bytes. Values are clamped to the float16 range
  ``[-65504, 65504]`` first (an overflow to inf would be a non-finite message); within it the
  error is at most ``2**-11 * |x| + 2**-25`` (round-to-nearest; the second term covers subnormals),
  beyond it the error is ``|x| - 65504``.
* ``int8``: bitsandbytes blockwise 8-bit quantization with the fixed signed dynamic map
  (``create_dynamic_map(signed=True)``, never sent) and ``blocksize`` 4096 by default. Wire format,
  all little-endian: a 24-byte header (magic ``b"SWQ8"``, u16 version 1, u16 flags 0, u64 numel,
  u32 blocksize, u32 number of blocks), then one float32 absmax per block, then one uint8 code per
  element: ``24 + 4 * ceil(numel / blocksize) + numel`` bytes. The error is at most
  :data:`INT8_REL_ERROR_BOUND` (0.0071) times the absmax of the element's block: the widest gap of
  the dynamic map is 0.01406 (half: 0.00703), and bnb's CPU search rounds slightly off the
  midpoint (worst measured: 0.007046 over 4e7 uniform values with block scales spread over e**±40).
  A block whose absmax is subnormal (below 1.2e-38) may lose its values entirely (an error of at
  most their own size), so the bound adds :data:`INT8_ABS_ERROR_FLOOR`, the smallest normal float32.

Measured on this project's 2-core CPU (torch 2.13, bitsandbytes 0.50.2):

* int8, ``torch.randn(10**6)``, blocksize 4096: max error / block absmax 0.00705, mean 0.00263;
  3.996x smaller than fp32 (blocksize 64: max 0.00705, mean 0.00291, 3.765x).
* Throughput for 25M floats (100 MB of float32; MB/s of float32 input, best of 3, encode / decode;
  the ranges span runs on a shared machine): fp32 480-510 / 3900-4900, fp16 440-800 / 1770,
  int8 290-410 / 1680-1820. Encoding includes the finiteness check; decoding includes the copy
  out of the message and, for fp32 and fp16, the finiteness check.
"""

from __future__ import annotations

import functools
import logging
import math
import struct
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

MAX_NUMEL = 2**31 - 1
"""Largest vector any codec encodes or decodes (bitsandbytes indexes elements with int32)."""
FP16_MAX = 65504.0
"""Largest finite float16; ``fp16`` clamps to ``[-FP16_MAX, FP16_MAX]``."""
INT8_REL_ERROR_BOUND = 0.0071
"""``int8``: bound on ``|decode(encode(x)) - x|`` divided by the absmax of the element's block."""
INT8_ABS_ERROR_FLOOR = float(torch.finfo(torch.float32).tiny)
"""``int8``: absolute term of the bound, for blocks with a subnormal absmax."""
INT8_BLOCKSIZES = (64, 128, 256, 512, 1024, 2048, 4096)
"""Blocksizes bitsandbytes supports on every backend (CPU ones also take larger; we keep to these)."""

_INT8_MAGIC = b"SWQ8"
_INT8_VERSION = 1
_INT8_HEADER = struct.Struct("<4sHHQII")  # magic, version, flags, numel, blocksize, num_blocks


class Codec(ABC):
    """Turns a finite 1-D float32 CPU vector into bytes and back; see the module docstring."""

    __slots__ = ()
    name: ClassVar[str]

    @abstractmethod
    def encode(self, t: torch.Tensor) -> bytes:
        """Encodes a finite 1-D float32 CPU tensor; raises ValueError for anything else."""

    @abstractmethod
    def decode(self, data: bytes, *, numel: int) -> torch.Tensor:
        """Decodes a message for a vector of ``numel``; raises ValueError if it is not a valid one."""

    @abstractmethod
    def wire_bytes(self, numel: int) -> int:
        """Exact length of ``encode(t)`` for any ``t`` of ``numel`` elements."""

    @abstractmethod
    def error_bound(self, t: torch.Tensor) -> torch.Tensor:
        """Elementwise bound on ``|decode(encode(t)) - t|`` (float64, same shape as ``t``)."""

    def warm(self) -> None:
        """Load what the codec needs on its first use (bitsandbytes: 3.3 s here, idle), e.g. beside start-up,
        so that a round's sender deadline does not pay for it."""
        self.decode(self.encode(torch.zeros(1)), numel=1)

    def max_abs_error(self, t: torch.Tensor) -> float:
        """Bound on ``max |decode(encode(t)) - t|``; 0.0 for an empty vector."""
        bound = self.error_bound(t)
        return float(bound.max()) if bound.numel() else 0.0


class _FloatCodec(Codec):
    """What the IEEE float codecs share: little-endian values of one width, ``_wire`` (a numpy dtype)."""

    __slots__ = ()
    _wire: ClassVar[str]

    def decode(self, data: bytes, *, numel: int) -> torch.Tensor:
        view = _check_message(self, data, numel=numel)
        return _finite_output(self, np.frombuffer(view, dtype=self._wire).astype(np.float32))

    def wire_bytes(self, numel: int) -> int:
        return np.dtype(self._wire).itemsize * _check_numel(numel)


@dataclass(frozen=True, kw_only=True, slots=True)
class Fp32Codec(_FloatCodec):
    """Raw little-endian float32: exact, 4 bytes per element."""

    name: ClassVar[str] = "fp32"
    _wire: ClassVar[str] = "<f4"

    def encode(self, t: torch.Tensor) -> bytes:
        return _check_vector(t).numpy().astype(self._wire, copy=False).tobytes()

    def error_bound(self, t: torch.Tensor) -> torch.Tensor:
        return torch.zeros(_check_vector(t).numel(), dtype=torch.float64)


@dataclass(frozen=True, kw_only=True, slots=True)
class Fp16Codec(_FloatCodec):
    """Little-endian float16 after clamping to ``±FP16_MAX``: 2 bytes per element."""

    name: ClassVar[str] = "fp16"
    _wire: ClassVar[str] = "<f2"

    def encode(self, t: torch.Tensor) -> bytes:
        half = _check_vector(t).clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
        return half.numpy().astype(self._wire, copy=False).tobytes()

    def error_bound(self, t: torch.Tensor) -> torch.Tensor:
        magnitude = _check_vector(t).abs().double()
        in_range = magnitude * 2.0**-11 + 2.0**-25
        return torch.where(magnitude > FP16_MAX, magnitude - FP16_MAX, in_range)


@dataclass(frozen=True, kw_only=True, slots=True)
class Int8Codec(Codec):
    """bitsandbytes blockwise 8-bit with a self-describing, pickle-free header."""

    name: ClassVar[str] = "int8"
    blocksize: int = 4096
    """Elements per block; each block carries its own float32 absmax. One of INT8_BLOCKSIZES."""

    def __post_init__(self) -> None:
        if isinstance(self.blocksize, bool) or self.blocksize not in INT8_BLOCKSIZES:
            raise ValueError(f"blocksize: must be one of {INT8_BLOCKSIZES}, got {self.blocksize!r}")

    def encode(self, t: torch.Tensor) -> bytes:
        t = _check_vector(t)
        num_blocks = self._num_blocks(t.numel())
        header = _INT8_HEADER.pack(_INT8_MAGIC, _INT8_VERSION, 0, t.numel(), self.blocksize, num_blocks)
        if t.numel() == 0:
            return header
        bnb_functional = _bnb_functional()
        codes, state = bnb_functional.quantize_blockwise(t, code=_dynamic_map(), blocksize=self.blocksize)
        absmax = state.absmax.numpy().astype("<f4", copy=False)
        return b"".join((header, absmax.tobytes(), codes.numpy().tobytes()))

    def decode(self, data: bytes, *, numel: int) -> torch.Tensor:
        view = _check_message(self, data, numel=numel)
        self._check_header(view, numel=numel)
        num_blocks = self._num_blocks(numel)
        if numel == 0:
            return torch.zeros(0, dtype=torch.float32)
        absmax = np.frombuffer(view, dtype="<f4", count=num_blocks, offset=_INT8_HEADER.size)
        bad = ~np.isfinite(absmax) | (absmax < 0)
        if bad.any():
            block = int(np.argmax(bad))
            raise ValueError(
                f"int8 message: absmax of block {block} is {float(absmax[block])!r}; it must be finite and non-negative"
            )
        codes = np.frombuffer(view, dtype=np.uint8, count=numel, offset=_INT8_HEADER.size + 4 * num_blocks)
        return _bnb_functional().dequantize_blockwise(
            torch.from_numpy(codes.copy()),
            absmax=torch.from_numpy(absmax.astype(np.float32)),
            code=_dynamic_map(),
            blocksize=self.blocksize,
        )

    def wire_bytes(self, numel: int) -> int:
        return _INT8_HEADER.size + 4 * self._num_blocks(numel) + _check_numel(numel)

    def error_bound(self, t: torch.Tensor) -> torch.Tensor:
        t = _check_vector(t)
        padded = torch.zeros(self._num_blocks(t.numel()) * self.blocksize, dtype=torch.float64)
        padded[: t.numel()] = t.abs()
        block_absmax = padded.view(-1, self.blocksize).amax(dim=1)
        bound = INT8_REL_ERROR_BOUND * block_absmax + INT8_ABS_ERROR_FLOOR
        return bound.repeat_interleave(self.blocksize)[: t.numel()]

    def _num_blocks(self, numel: int) -> int:
        return -(-_check_numel(numel) // self.blocksize)

    def _check_header(self, view: memoryview, *, numel: int) -> None:
        magic, version, flags, got_numel, blocksize, num_blocks = _INT8_HEADER.unpack_from(view)
        expected = {
            "magic": (magic, _INT8_MAGIC),
            "version": (version, _INT8_VERSION),
            "flags": (flags, 0),
            "numel": (got_numel, numel),
            "blocksize": (blocksize, self.blocksize),
            "number of blocks": (num_blocks, self._num_blocks(numel)),
        }
        for field, (got, want) in expected.items():
            if got != want:
                raise ValueError(f"int8 message: header {field} is {got!r}, expected {want!r}")


_CODECS: dict[str, type[Codec]] = {codec.name: codec for codec in (Fp32Codec, Fp16Codec, Int8Codec)}
CODEC_NAMES = tuple(_CODECS)
"""Names :func:`get_codec` accepts."""


def get_codec(name: str) -> Codec:
    """The codec called ``name`` with its default settings; ValueError lists the known names."""
    if name not in _CODECS:
        raise ValueError(f"unknown codec {name!r}; known codecs: {', '.join(CODEC_NAMES)}")
    return _CODECS[name]()


def wire_bytes(codec: Codec, numel: int) -> int:
    """Exact size of ``codec``'s message for a vector of ``numel`` elements."""
    return codec.wire_bytes(numel)


# --- helpers ------------------------------------------------------------------------------------


def _check_numel(numel: int) -> int:
    if isinstance(numel, bool) or not isinstance(numel, int) or not 0 <= numel <= MAX_NUMEL:
        raise ValueError(f"numel: must be an integer in [0, {MAX_NUMEL}], got {numel!r}")
    return numel


def _check_vector(t: torch.Tensor) -> torch.Tensor:
    """The contiguous tensor itself if it is a finite 1-D float32 CPU vector; else ValueError."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32 or t.dim() != 1 or t.device.type != "cpu":
        raise ValueError(
            f"expected a 1-D float32 CPU tensor, got dtype={t.dtype}, shape={tuple(t.shape)}, "
            f"device={t.device}; flatten it and call .float().cpu() first"
        )
    _check_numel(t.numel())
    t = t.detach().contiguous()
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"cannot encode a vector with {int((~torch.isfinite(t)).sum())} non-finite values")
    return t


def _check_message(codec: Codec, data: bytes, *, numel: int) -> memoryview:
    """A byte view of ``data`` once its length is exactly ``codec.wire_bytes(numel)``."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"{codec.name} message: expected bytes, got {type(data).__name__}")
    try:
        view = memoryview(data).cast("B")
    except TypeError as error:  # a strided or multi-dimensional memoryview
        raise ValueError(f"{codec.name} message: expected contiguous bytes: {error}") from None
    expected = codec.wire_bytes(numel)
    if view.nbytes != expected:
        raise ValueError(f"{codec.name} message: {view.nbytes} bytes, expected exactly {expected} for {numel} elements")
    return view


def _finite_output(codec: Codec, values: np.ndarray) -> torch.Tensor:
    finite = np.isfinite(values)
    if not finite.all():
        index = int(np.argmin(finite))
        raise ValueError(f"{codec.name} message: element {index} is {float(values[index])!r}, not finite")
    return torch.from_numpy(values)


_BNB_PROBE_LOGGERS = ("bitsandbytes.backends.cpu.ops", "bitsandbytes.cextension")
"""bitsandbytes loggers that warn at import about optional kernels no codec or optimizer of ours uses
(e.g. "Failed to load CPU gemm_4bit_forward from kernels-community" on every CPU start)."""


def import_bitsandbytes() -> Any:
    """``import bitsandbytes`` without its import-time probe warnings (real errors still raise), and without
    compiling its pure-torch fallback kernels.

    bitsandbytes wraps those fallbacks (``backends/default/ops.py``) in ``torch.compile`` at import, which
    imports TorchInductor: 0.9 s of CPU in every process that averages in int8, measured here (1.32 s to
    import it after torch._dynamo, 0.45 s without). The fallbacks only run where no device kernel is registered (the
    CPU kernels need bitsandbytes' native library; CUDA has its own); there they now run eagerly instead of
    compiling on their first call. For the import alone, ``torch.compile`` returns its function as it is (what
    ``disable=True`` or ``TORCHDYNAMO_DISABLE=1`` return); torch._dynamo is imported first, as any optimizer would.

    Nor is the environment written: a real ``torch.compile`` call, even a disabled one, sets
    ``TORCHINDUCTOR_CACHE_DIR`` (14 writes in this import), and so did the ``TORCHDYNAMO_DISABLE`` this used
    to set. A process may import this on its first int8 round, beside other threads, and ``setenv`` may move
    the C environment while another thread's ``getenv`` walks it (logging's ``localtime`` reads ``TZ``): a
    use-after-free. Another thread that calls ``torch.compile`` during the import gets its function back.
    """
    for name in _BNB_PROBE_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    if "bitsandbytes.functional" not in sys.modules:
        import torch._dynamo  # noqa: F401

        compile_ = torch.compile
        torch.compile = _uncompiled
        try:
            import bitsandbytes.functional  # noqa: F401  (the codec's quantize_blockwise / dequantize_blockwise)
        finally:
            torch.compile = compile_
    import bitsandbytes

    return bitsandbytes


def _uncompiled(model: Any = None, **_options: Any) -> Any:
    """``torch.compile`` without compiling, as a decorator or a call."""
    return model if model is not None else (lambda fn: fn)


@functools.cache
def _bnb_functional():
    # imported on first use: bitsandbytes is slow to import and logs backend probes
    return import_bitsandbytes().functional


@functools.cache
def _dynamic_map() -> torch.Tensor:
    code = _bnb_functional().create_dynamic_map(signed=True)
    assert code.shape == (256,) and math.isclose(float(code.abs().max()), 1.0), "unexpected dynamic map"
    return code
