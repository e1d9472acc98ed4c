"""One conformance suite for every wire codec in `averaging.compression`.

Each test runs against every codec (and int8 with the smallest blocksize too): round trip within
the codec's documented bound, exact `wire_bytes`, edge lengths and magnitudes, and decoders that
answer untrusted bytes with `ValueError` only. Random inputs come from a seeded generator and every
assertion message names the seed; the byte fuzzers use hypothesis with derandomize=True.
"""

from __future__ import annotations

import math
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from averaging.compression import CODEC_NAMES, FP16_MAX, MAX_NUMEL, Codec, Int8Codec, get_codec, wire_bytes

CODECS: list[Codec] = [get_codec(name) for name in CODEC_NAMES] + [Int8Codec(blocksize=64)]
CODEC_IDS = [f"{codec.name}-{getattr(codec, 'blocksize', '')}".rstrip("-") for codec in CODECS]
LENGTHS = [0, 1, 7, 63, 65, 4095, 4096, 4097, 10**5 + 3]
FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


@pytest.fixture(params=CODECS, ids=CODEC_IDS)
def codec(request: pytest.FixtureRequest) -> Codec:
    return request.param


def _randn(numel: int, *, seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(numel, generator=generator, dtype=torch.float64) * scale).float()


def _documented_bound(codec: Codec, x: torch.Tensor) -> torch.Tensor:
    """The bound as the module docstring states it, computed independently of `error_bound`."""
    magnitude = x.double().abs()
    if codec.name == "fp32":
        return torch.zeros_like(magnitude)
    if codec.name == "fp16":
        return torch.where(magnitude > FP16_MAX, magnitude - FP16_MAX, 1e-3 * magnitude + 2.0**-25)
    assert isinstance(codec, Int8Codec)
    blocks = [block for block in torch.split(magnitude, codec.blocksize) if block.numel()]
    absmax = torch.cat([torch.full_like(block, float(block.max())) for block in blocks] + [magnitude[:0]])
    return 0.0071 * absmax + 2.0**-126  # the docstring's figures, not the constants they document


def _check_round_trip(codec: Codec, x: torch.Tensor, *, seed: int) -> None:
    data = codec.encode(x)
    assert isinstance(data, bytes)
    assert len(data) == codec.wire_bytes(x.numel()) == wire_bytes(codec, x.numel()), f"seed={seed}"
    y = codec.decode(data, numel=x.numel())
    assert y.dtype == torch.float32 and y.shape == x.shape and bool(torch.isfinite(y).all()), f"seed={seed}"
    error = (y.double() - x.double()).abs()
    for name, bound in (("error_bound", codec.error_bound(x)), ("documented", _documented_bound(codec, x))):
        excess = error - bound
        assert bool((excess <= 0).all()), (
            f"seed={seed}: {codec.name} {name} bound broken at index {int(excess.argmax())}: "
            f"error {float(error[excess.argmax()])!r} > bound {float(bound[excess.argmax()])!r}"
        )
    assert codec.max_abs_error(x) == (float(codec.error_bound(x).max()) if x.numel() else 0.0)


# --- round trips ----------------------------------------------------------------------------------


@pytest.mark.parametrize("numel", LENGTHS)
def test_round_trip_within_bound(codec: Codec, numel: int) -> None:
    seed = 1000 + numel
    _check_round_trip(codec, _randn(numel, seed=seed), seed=seed)


@pytest.mark.parametrize("scale", [1e-40, 1e-30, 1e-6, 1e4, 1e30, 1e38])
def test_magnitudes_within_bound(codec: Codec, scale: float) -> None:
    seed = 7
    x = _randn(5000, seed=seed, scale=scale).clamp(-3e38, 3e38)
    _check_round_trip(codec, x, seed=seed)


def test_mixed_magnitudes_in_one_block(codec: Codec) -> None:
    seed = 11
    x = _randn(4097, seed=seed, scale=1e-3)
    x[::500] = torch.tensor([1e5, -3e4, 7.0, -1e-20, 65504.0, 65520.0, -1e6, 0.5, 2e-8])
    _check_round_trip(codec, x, seed=seed)


def test_zero_vector_is_exact(codec: Codec) -> None:
    for numel in (1, 4097):
        y = codec.decode(codec.encode(torch.zeros(numel)), numel=numel)
        assert torch.equal(y, torch.zeros(numel))


def test_fp32_is_exact_and_fp16_halves_the_bytes() -> None:
    x = _randn(1001, seed=3)
    assert torch.equal(get_codec("fp32").decode(get_codec("fp32").encode(x), numel=1001), x)
    assert get_codec("fp32").encode(x) == x.numpy().astype("<f4").tobytes()
    assert wire_bytes(get_codec("fp16"), 1001) == 2002
    assert wire_bytes(get_codec("int8"), 10**6) == 24 + 4 * math.ceil(10**6 / 4096) + 10**6


def test_encode_rejects_what_it_cannot_send(codec: Codec) -> None:
    bad = [
        torch.tensor([1.0, float("nan")]),
        torch.tensor([float("inf"), 1.0]),
        torch.zeros(4, dtype=torch.float64),
        torch.zeros(2, 2),
        [1.0, 2.0],
    ]
    for value in bad:
        with pytest.raises(ValueError):
            codec.encode(value)  # type: ignore[arg-type]


# --- untrusted bytes ------------------------------------------------------------------------------


@pytest.mark.parametrize("numel", [1, 4095, 4097])
def test_decode_rejects_wrong_lengths(codec: Codec, numel: int) -> None:
    data = codec.encode(_randn(numel, seed=numel))
    for wrong in (data[:-1], data[: len(data) // 2], b"", data + b"\0", data + data):
        with pytest.raises(ValueError, match="bytes, expected exactly"):
            codec.decode(wrong, numel=numel)
    with pytest.raises(ValueError):
        codec.decode(data, numel=numel + 1)


@pytest.mark.parametrize("numel", [-1, 1.5, True, None, MAX_NUMEL + 1])
def test_decode_rejects_bad_numel(codec: Codec, numel: object) -> None:
    with pytest.raises(ValueError, match="numel"):
        codec.decode(b"", numel=numel)  # type: ignore[arg-type]


def _poisoned(codec: Codec, data: bytes, value: float) -> bytes:
    """`data` with one non-finite scale or value written where the codec keeps it."""
    if codec.name == "fp32":
        return struct.pack("<f", value) + data[4:]
    if codec.name == "fp16":
        return np.array([value], dtype="<f2").tobytes() + data[2:]
    return data[:24] + struct.pack("<f", value) + data[28:]  # int8: the first block's absmax


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_decode_rejects_non_finite_scales_and_values(codec: Codec, value: float) -> None:
    data = codec.encode(_randn(5000, seed=5))
    with pytest.raises(ValueError, match="finite"):
        codec.decode(_poisoned(codec, data, value), numel=5000)


def test_decode_accepts_bytearray_and_memoryview(codec: Codec) -> None:
    x = _randn(100, seed=9)
    data = codec.encode(x)
    expected = codec.decode(data, numel=100)
    assert torch.equal(codec.decode(bytearray(data), numel=100), expected)
    assert torch.equal(codec.decode(memoryview(data), numel=100), expected)
    with pytest.raises(ValueError, match="expected bytes"):
        codec.decode(data.decode("latin-1"), numel=100)  # type: ignore[arg-type]


@given(data=st.binary(max_size=600), numel=st.integers(min_value=0, max_value=150))
@FUZZ
def test_decode_random_bytes_only_raises_value_error(codec: Codec, data: bytes, numel: int) -> None:
    _decode_or_value_error(codec, data, numel=numel)


@given(
    positions=st.lists(st.integers(min_value=0, max_value=10**6), min_size=1, max_size=4),
    replacement=st.binary(min_size=1, max_size=4),
    numel=st.sampled_from([1, 64, 65, 300]),
)
@FUZZ
def test_decode_corrupted_messages_only_raise_value_error(
    codec: Codec, positions: list[int], replacement: bytes, numel: int
) -> None:
    data = bytearray(codec.encode(_randn(numel, seed=numel)))
    for position, byte in zip(positions, replacement * 4):
        data[position % len(data)] = byte
    _decode_or_value_error(codec, bytes(data), numel=numel)


def _decode_or_value_error(codec: Codec, data: bytes, *, numel: int) -> None:
    try:
        y = codec.decode(data, numel=numel)
    except ValueError:
        return
    assert len(data) == codec.wire_bytes(numel)
    assert y.dtype == torch.float32 and y.shape == (numel,) and bool(torch.isfinite(y).all())


# --- codec-specific contracts ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "offset", "fmt", "value"),
    [
        ("magic", 0, "<4s", b"SWQ9"),
        ("version", 4, "<H", 2),
        ("flags", 6, "<H", 1),
        ("numel", 8, "<Q", 4098),
        ("blocksize", 16, "<I", 2048),
        ("number of blocks", 20, "<I", 3),
    ],
)
def test_int8_header_fields_are_checked(field: str, offset: int, fmt: str, value: object) -> None:
    codec = Int8Codec()
    data = bytearray(codec.encode(_randn(4097, seed=1)))
    struct.pack_into(fmt, data, offset, value)
    with pytest.raises(ValueError, match=f"header {field} is"):
        codec.decode(bytes(data), numel=4097)


def test_int8_rejects_negative_absmax_and_other_blocksizes() -> None:
    data = Int8Codec().encode(_randn(5000, seed=2))
    with pytest.raises(ValueError, match="non-negative"):
        Int8Codec().decode(data[:24] + struct.pack("<f", -1.0) + data[28:], numel=5000)
    with pytest.raises(ValueError):
        Int8Codec(blocksize=64).decode(data, numel=5000)
    for blocksize in (0, 100, 8192, True):
        with pytest.raises(ValueError, match="blocksize"):
            Int8Codec(blocksize=blocksize)


def test_int8_compresses_about_four_times() -> None:
    numel = 10**6
    assert 3.9 < 4 * numel / wire_bytes(get_codec("int8"), numel) < 4.0


def test_get_codec_lists_known_names() -> None:
    assert set(CODEC_NAMES) == {"fp32", "fp16", "int8"}
    with pytest.raises(ValueError, match="fp32, fp16, int8"):
        get_codec("zstd")


def test_bitsandbytes_starts_without_its_optional_kernel_warnings():
    """bitsandbytes warns at import about kernels no codec or optimizer of ours uses ("Failed to load CPU
    gemm_4bit_forward from kernels-community" on CPUs with avx512bf16); the int8 codec and adamw8bit start
    quietly. Nor do they import TorchInductor for bitsandbytes' torch.compile'd fallback kernels (0.9 s of
    CPU in every peer), and torch.compile still compiles afterwards. Nor do they write the process's
    environment: a peer first uses the codec in a round, beside other threads, where ``setenv`` is unsafe
    (torch._dynamo's own import writes it once: imported before the spy, as a first optimizer step does)."""
    code = (
        "import os, sys, torch, torch._dynamo; writes = []; os.putenv = lambda k, v: writes.append(k); "
        "os.unsetenv = lambda k: writes.append(k); from averaging.compression import get_codec; "
        "from swarm.peer import PeerConfig, make_inner_optimizer; get_codec('int8').encode(torch.randn(4096)); "
        "make_inner_optimizer(PeerConfig(optimizer='adamw8bit'), torch.nn.Linear(4, 4).parameters()); "
        "print('inductor', 'torch._inductor.compile_fx' in sys.modules, 'env', writes); "
        "f = lambda x: x + 1; print('compiles', torch.compile(f) is not f)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Failed to load" not in done.stderr and "gemm_4bit" not in done.stderr, done.stderr
    assert done.stdout.split("\n")[:2] == ["inductor False env []", "compiles True"], done.stdout
