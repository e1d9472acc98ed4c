"""The content-addressed checkpoint store: round trip, corruption, unsafe files, atomic writes, pruning.

TESTMATRIX row 11 (1000 seeded single-bit flips at rest, all detected; flips in transit refused)
and row 19 (a pickle placed as a shard is refused and never executed).
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import random
import time

import pytest
import torch
from safetensors.torch import save as safetensors_save

from swarm.checkpoint import CheckpointStore, Manifest, ShardInfo, ShardRejected, SignedManifest, TensorInfo
from swarm.checkpoint import store as store_module


@pytest.fixture
def store(tmp_path) -> CheckpointStore:
    return CheckpointStore(tmp_path / "ckpt", keep_last=3)


def state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "layer.0.weight": torch.randn(16, 8, generator=g),
        "layer.0.bias": torch.randn(16, generator=g).half(),
        "layer.1.weight": torch.randn(8, 16, generator=g).bfloat16(),
        "step": torch.tensor(seed, dtype=torch.int64),
        "counts": torch.arange(6, dtype=torch.int32),
        "bytes": torch.arange(10, dtype=torch.uint8),
        "mask": torch.rand(5, generator=g) > 0.5,
    }


def only_file(folder) -> list:
    return sorted(p.name for p in folder.iterdir())


def test_round_trip_every_allowed_dtype(store):
    tensors = state_dict()
    shards = store.put_tensors(tensors)
    assert len(shards) == 1 and shards[0].size_bytes == store.shard_path(shards[0].digest).stat().st_size
    loaded = store.load_tensors(shards[0])
    assert list(loaded) == list(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    assert {t.dtype for t in shards[0].tensors} == {"float32", "float16", "bfloat16", "int64", "int32", "uint8", "bool"}
    assert store.rejected == {}


def test_sharding_by_size_and_a_large_tensor_alone(store):
    tensors = {"a": torch.zeros(100), "b": torch.zeros(100), "big": torch.zeros(1000), "c": torch.zeros(10)}
    shards = store.put_tensors(tensors, max_shard_bytes=1000)
    assert [[t.name for t in s.tensors] for s in shards] == [["a", "b"], ["big"], ["c"]]
    assert [s.name for s in shards] == ["shard-00000", "shard-00001", "shard-00002"]
    assert store.load_state_dict(_manifest(shards)).keys() == tensors.keys()


def test_put_is_idempotent_and_content_addressed(store):
    first = store.put_tensors(state_dict())
    mtime = store.shard_path(first[0].digest).stat().st_mtime_ns
    second = store.put_tensors(state_dict())
    assert first == second
    assert store.shard_path(first[0].digest).stat().st_mtime_ns == mtime
    assert len(list(store.shards_dir.iterdir())) == 1
    data = store.shard_path(first[0].digest).read_bytes()
    assert hashlib.sha256(data).hexdigest() == first[0].digest


def test_tied_and_non_contiguous_tensors(store):
    weight = torch.randn(4, 4)
    shards = store.put_tensors({"embed": weight, "head": weight, "t": weight.t()})
    loaded = store.load_tensors(shards[0])
    assert torch.equal(loaded["embed"], weight) and torch.equal(loaded["head"], weight)
    assert torch.equal(loaded["t"], weight.t())


@pytest.mark.parametrize("value", [torch.zeros(3, dtype=torch.float64), torch.zeros(2, dtype=torch.complex64)])
def test_put_refuses_disallowed_dtype(store, value):
    with pytest.raises(ValueError, match="cannot be stored"):
        store.put_tensors({"x": value})
    assert only_file(store.shards_dir) == []


def test_put_shard_bytes_checks_digest_size_and_header(store):
    data = safetensors_save({"x": torch.ones(3)})
    digest = hashlib.sha256(data).hexdigest()
    assert store.put_shard_bytes(data, expected_digest=digest, expected_size_bytes=len(data)) == store.shard_path(
        digest
    )
    assert store.read_shard(digest) == data

    other = safetensors_save({"x": torch.zeros(3)})
    for kwargs, reason in [
        ({"expected_digest": hashlib.sha256(other).hexdigest()}, "digest mismatch"),
        ({"expected_digest": digest, "expected_size_bytes": len(data) + 1}, "size mismatch"),
    ]:
        with pytest.raises(ShardRejected) as info:
            store.put_shard_bytes(data if reason == "size mismatch" else data[:-1] + b"\x01", **kwargs)
        assert info.value.reason == reason
    assert store.rejected == {"digest mismatch": 1, "size mismatch": 1}


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (safetensors_save({"x": torch.zeros(3, dtype=torch.float64)}), "unexpected dtype"),
        (safetensors_save({"x": torch.zeros(3, dtype=torch.int8)}), "unexpected dtype"),
        (b"", "not safetensors"),
        (b"garbage!" * 10, "not safetensors"),
        ((10).to_bytes(8, "little") + b"[1,2,3,4,5]", "not safetensors"),
        ((2**40).to_bytes(8, "little") + b"{}", "not safetensors"),
        (safetensors_save({"x": torch.zeros(3)}) + b"trailing", "not safetensors"),
        (safetensors_save({"x": torch.zeros(3)})[:-1], "not safetensors"),
    ],
)
def test_put_shard_bytes_refuses_unsafe_or_broken_files(store, data, reason):
    digest = hashlib.sha256(data).hexdigest()
    with pytest.raises(ShardRejected) as info:
        store.put_shard_bytes(data, expected_digest=digest)
    assert info.value.reason == reason
    assert store.rejected == {reason: 1}
    assert not store.has(digest) and only_file(store.shards_dir) == []


def test_1000_single_bit_flips_at_rest_are_all_detected(store):
    seed = random.randrange(2**32)
    print(f"bit-flip seed={seed}")
    rng = random.Random(seed)
    shard = store.put_tensors({"w": torch.randn(32, 8), "b": torch.arange(16)})[0]
    path = store.shard_path(shard.digest)
    original = path.read_bytes()
    detected = 0
    for _ in range(1000):
        corrupt = bytearray(original)
        corrupt[rng.randrange(len(corrupt))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(corrupt))
        try:
            store.read_shard(shard.digest)
        except ShardRejected as e:
            assert e.reason == "digest mismatch", f"seed={seed}: {e}"
            detected += 1
    assert detected == 1000, f"seed={seed}: only {detected}/1000 flips detected"
    assert store.rejected == {"digest mismatch": 1000}
    path.write_bytes(original)
    assert torch.equal(store.load_tensors(shard)["b"], torch.arange(16))


def test_bit_flips_in_transit_are_refused_and_never_stored(store):
    seed = random.randrange(2**32)
    print(f"transit seed={seed}")
    rng = random.Random(seed)
    data = safetensors_save({"w": torch.randn(32, 8)})
    digest = hashlib.sha256(data).hexdigest()
    for _ in range(200):
        corrupt = bytearray(data)
        corrupt[rng.randrange(len(corrupt))] ^= 1 << rng.randrange(8)
        with pytest.raises(ShardRejected, match="digest mismatch"):
            store.put_shard_bytes(bytes(corrupt), expected_digest=digest)
    assert store.rejected == {"digest mismatch": 200}, f"seed={seed}"
    assert only_file(store.shards_dir) == []


class _Exploit:
    """Unpickling this creates a marker directory: proof that pickle ran."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def _pickle_payloads(marker: str) -> dict[str, bytes]:
    zipped, legacy = io.BytesIO(), io.BytesIO()
    torch.save({"w": torch.ones(3), "evil": _Exploit(marker)}, zipped)
    torch.save({"w": torch.ones(3)}, legacy, _use_new_zipfile_serialization=False)
    return {
        "torch.save": zipped.getvalue(),
        "legacy torch.save": legacy.getvalue(),
        "raw pickle": pickle.dumps(_Exploit(marker)),
    }


@pytest.mark.parametrize("kind", ["torch.save", "legacy torch.save", "raw pickle"])
def test_pickle_placed_as_a_shard_is_refused_and_never_run(store, tmp_path, monkeypatch, kind):
    marker = tmp_path / "pwned"
    data = _pickle_payloads(str(marker))[kind]
    digest = hashlib.sha256(data).hexdigest()
    store.shard_path(digest).write_bytes(data)  # e.g. copied in by hand, or a tampered donor's file

    def forbidden(*args, **kwargs):
        raise AssertionError("pickle must never be loaded")

    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    info = ShardInfo(
        name="shard-00000",
        digest=digest,
        size_bytes=len(data),
        tensors=(TensorInfo(name="w", dtype="float32", shape=(3,)),),
    )
    with pytest.raises(ShardRejected, match=r"not a safetensors file \(pickle is never loaded\)") as err:
        store.load_tensors(info)
    assert err.value.reason == "not safetensors"
    with pytest.raises(ShardRejected, match="pickle is never loaded"):
        store.put_shard_bytes(data, expected_digest=digest)
    assert store.rejected == {"not safetensors": 2}
    assert not marker.exists()


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        ({"dtype": "float16"}, "unexpected dtype"),
        ({"shape": (3, 1)}, "shape mismatch"),
        ({"name": "other"}, "tensor names mismatch"),
    ],
)
def test_load_refuses_a_shard_that_differs_from_its_manifest_entry(store, edit, reason):
    shard = store.put_tensors({"w": torch.ones(3), "b": torch.zeros(2)})[0]
    tensors = tuple(
        TensorInfo(**{"name": t.name, "dtype": t.dtype, "shape": t.shape, **edit}) if t.name == "w" else t
        for t in shard.tensors
    )
    lying = ShardInfo(name=shard.name, digest=shard.digest, size_bytes=shard.size_bytes, tensors=tensors)
    with pytest.raises(ShardRejected) as info:
        store.load_tensors(lying)
    assert info.value.reason == reason
    assert store.rejected == {reason: 1}


def test_load_refuses_missing_extra_tensor_and_wrong_size(store):
    shard = store.put_tensors({"w": torch.ones(3), "b": torch.zeros(2)})[0]
    fewer = ShardInfo(name=shard.name, digest=shard.digest, size_bytes=shard.size_bytes, tensors=shard.tensors[:1])
    with pytest.raises(ShardRejected, match="tensor names mismatch"):
        store.load_tensors(fewer)
    wrong_size = ShardInfo(name=shard.name, digest=shard.digest, size_bytes=shard.size_bytes + 1, tensors=shard.tensors)
    with pytest.raises(ShardRejected, match="size mismatch"):
        store.load_tensors(wrong_size)


def test_missing_shard_and_bad_digest(store):
    with pytest.raises(FileNotFoundError, match="fetch it from a donor"):
        store.read_shard("ab" * 32)
    for bad in ["../../etc/passwd", "AB" * 32, "ab" * 31]:
        with pytest.raises(ValueError, match="64 lowercase hex"):
            store.read_shard(bad)


def test_crash_before_rename_never_exposes_a_partial_file(store, monkeypatch):
    data = safetensors_save({"x": torch.ones(1000)})
    digest = hashlib.sha256(data).hexdigest()
    calls: list[str] = []
    real_fsync = os.fsync

    def record_fsync(fd):
        calls.append("fsync")
        real_fsync(fd)

    def crash(src, dst):
        calls.append("replace")
        assert os.path.getsize(src) == len(data)  # complete and synced before it may take the name
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(store_module.os, "fsync", record_fsync)
    monkeypatch.setattr(store_module.os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        store.put_shard_bytes(data, expected_digest=digest)
    assert calls == ["fsync", "replace"]
    assert not store.shard_path(digest).exists() and not store.has(digest)
    assert only_file(store.shards_dir) == []


def test_leftover_temp_files_are_ignored_then_pruned_when_stale(store):
    # a process killed mid-write leaves its temp file behind, never the final name
    stale = store.shards_dir / ".tmp-crashed.part"
    stale.write_bytes(b"half a shard")
    old = time.time() - 2 * 3600
    os.utime(stale, (old, old))
    fresh = store.manifests_dir / ".tmp-in-progress.part"
    fresh.write_bytes(b"{")
    assert store.list_manifests() == []
    shards = store.put_tensors({"x": torch.ones(2)})
    store.put_manifest(_signed_bytes(_manifest(shards)))
    result = store.prune()
    assert result.removed_temp_files == 1 and result.removed_shards == 0 and result.removed_manifests == 0
    assert not stale.exists() and fresh.exists()


def test_prune_keeps_the_last_k_and_removes_unreferenced_shards(store):
    shared = store.put_tensors({"frozen": torch.ones(4)})[0]
    digests, own_shards = [], []
    parent = ""
    for step in [5, 1, 4, 2, 3]:  # stored out of order: prune orders by step
        own = store.put_tensors({f"w{step}": torch.full((3,), float(step))})[0]
        manifest = _manifest([shared, own], step=step, parent=parent)
        digests.append((step, store.put_manifest(_signed_bytes(manifest))))
        own_shards.append((step, own.digest))
    orphan = store.put_tensors({"orphan": torch.zeros(1)})[0]
    corrupt = store.manifests_dir / f"{'ee' * 32}.json"
    corrupt.write_bytes(b"not json")
    by_step = dict(digests)
    assert store.list_manifests() == [by_step[s] for s in [1, 2, 3, 4, 5]]

    result = store.prune(keep={by_step[1]})
    assert result.removed_manifests == 2  # step 2 and the corrupt file
    assert result.removed_shards == 2  # step 2's own shard and the orphan
    assert store.list_manifests() == [by_step[s] for s in [1, 3, 4, 5]]
    for step, digest in own_shards:
        assert store.has(digest) == (step != 2)
    assert store.has(shared.digest) and not store.has(orphan.digest) and not corrupt.exists()

    result = store.prune()
    assert (result.removed_manifests, result.removed_shards) == (1, 1)
    assert store.list_manifests() == [by_step[s] for s in [3, 4, 5]]


def test_manifest_store_round_trip_and_corruption_at_rest(store):
    shards = store.put_tensors(state_dict())
    wire = _signed_bytes(_manifest(shards))
    digest = store.put_manifest(wire)
    assert store.get_manifest(digest) == wire
    assert SignedManifest.from_bytes(store.get_manifest(digest)).manifest.digest() == digest
    assert store.list_manifests() == [digest]  # parsed and remembered
    path = store.manifests_dir / f"{digest}.json"
    path.write_bytes(wire.replace(b'"step":1', b'"step":2'))  # same size, maybe the same mtime
    with pytest.raises(ValueError, match="digest mismatch"):
        store.get_manifest(digest)
    assert store.list_manifests() == []
    assert store.rejected["manifest digest mismatch"] >= 1


def test_missing_shards_of_a_manifest(store, tmp_path):
    shards = store.put_tensors({"a": torch.ones(300), "b": torch.ones(300)}, max_shard_bytes=1200)
    other = CheckpointStore(tmp_path / "other")
    manifest = _manifest(shards)
    assert other.missing_shards(manifest) == list(shards) and store.missing_shards(manifest) == []
    for shard in other.missing_shards(manifest):
        other.put_shard_bytes(
            store.read_shard(shard.digest), expected_digest=shard.digest, expected_size_bytes=shard.size_bytes
        )
    assert other.missing_shards(manifest) == []
    assert torch.equal(other.load_state_dict(manifest)["b"], torch.ones(300))


def _manifest(shards, *, step: int = 1, parent: str = "") -> Manifest:
    return Manifest(
        run_id="run-a",
        step=step,
        round=0,
        task="mlp-demo",
        config_digest="cd" * 32,
        parent=parent,
        shards=tuple(shards),
        participants=(),
        metrics={},
        created_at=1_700_000_000,
    )


def _signed_bytes(manifest: Manifest) -> bytes:
    return SignedManifest(manifest=manifest).to_bytes()


def test_a_shard_corrupt_at_rest_is_removed_and_fetched_again_once(store, tmp_path):
    """TESTMATRIX row 11 at rest, on the loading side: a joiner (or a restarted peer) holding a corrupt copy of one
    of the newest manifest's shards does not give up on that state; the copy is removed and fetched again.
    Other refusals are raised as they were, and nothing is removed for them."""
    donor = CheckpointStore(tmp_path / "donor")
    shards = donor.put_tensors({"a": torch.arange(300.0), "b": torch.ones(300)}, max_shard_bytes=1200)
    manifest = _manifest(shards)
    fetched: list[list[str]] = []

    def fetch(missing):
        fetched.append([s.digest for s in missing])
        for shard in missing:
            data = donor.read_shard(shard.digest)
            store.put_shard_bytes(data, expected_digest=shard.digest, expected_size_bytes=shard.size_bytes)

    assert torch.equal(store.load_fetching(manifest, fetch)["a"], torch.arange(300.0))  # a joiner: all missing
    assert fetched == [[s.digest for s in shards]]
    path = store.shard_path(shards[1].digest)
    corrupt = bytearray(path.read_bytes())
    corrupt[-1] ^= 0x01  # one bit of a tensor's data
    path.write_bytes(bytes(corrupt))
    fetched.clear()
    assert torch.equal(store.load_fetching(manifest, fetch)["b"], torch.ones(300))
    assert fetched == [[shards[1].digest]]  # the fault fired: only the corrupt shard came again
    assert store.rejected == {"digest mismatch": 1, "corrupt at rest, removed": 1}
    assert store.read_shard(shards[1].digest) == donor.read_shard(shards[1].digest)

    path.write_bytes(bytes(corrupt))  # the negative control: a source that cannot mend it
    with pytest.raises(ShardRejected, match="digest mismatch"):
        store.load_fetching(manifest, lambda missing: path.write_bytes(bytes(corrupt)))
    wrong = _manifest((ShardInfo(name=shards[0].name, digest=shards[0].digest, size_bytes=shards[0].size_bytes + 1,
                                 tensors=shards[0].tensors),))  # fmt: skip
    fetched.clear()
    with pytest.raises(ShardRejected, match="size mismatch"):  # not corruption at rest: nothing removed or fetched
        store.load_fetching(wrong, fetch)
    assert fetched == [] and store.has(shards[0].digest)
