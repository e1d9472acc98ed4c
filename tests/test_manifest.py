"""Signed checkpoint manifests: round trip, every rejection reason, replay, lineage, domain separation.

TESTMATRIX rows 12 (forged manifest) and 13 (replayed manifest): each forged or replayed manifest
is refused with its own reason, and the test checks that exactly one refusal was counted.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bootstrap.identity import BINDING_KIND, Identity, verify
from swarm.checkpoint import (
    MANIFEST_KIND,
    MAX_MANIFEST_BYTES,
    Manifest,
    ManifestRejected,
    ShardInfo,
    SignedManifest,
    TensorInfo,
    default_quorum,
    public_key_from_peer_id,
    sign_manifest,
    verify_lineage,
    verify_manifest,
)

RUN = "run-a"


@pytest.fixture(scope="module")
def group() -> list[Identity]:
    return sorted((Identity.generate() for _ in range(4)), key=lambda i: i.peer_id)


def make_manifest(group: list[Identity], *, step: int = 10, parent: str = "", run_id: str = RUN) -> Manifest:
    shard = ShardInfo(
        name="shard-00000",
        digest=f"{step:064x}",
        size_bytes=128,
        tensors=(
            TensorInfo(name="w", dtype="float32", shape=(4, 4)),
            TensorInfo(name="b", dtype="bfloat16", shape=(4,)),
        ),
    )
    return Manifest(
        run_id=run_id,
        step=step,
        round=step // 2,
        task="mlp-demo",
        config_digest="ab" * 32,
        parent=parent,
        shards=(shard,),
        participants=tuple(i.peer_id for i in group),
        metrics={"val_loss_micro": 2_310_000, "num_samples": 4096},
        created_at=1_700_000_000 + step,
    )


def seal(manifest: Manifest, signers: list[Identity]) -> SignedManifest:
    signed = SignedManifest(manifest=manifest)
    for identity in signers:
        signed = signed.with_signature(*sign_manifest(manifest, identity))
    return signed


def rejected(data, *, reason: str, **kwargs) -> ManifestRejected:
    """Assert verify_manifest refuses with ``reason`` and counts exactly that one refusal."""
    counter: Counter[str] = Counter()
    kwargs.setdefault("run_id", RUN)
    with pytest.raises(ManifestRejected) as info:
        verify_manifest(data, counter=counter, **kwargs)
    assert info.value.reason == reason, str(info.value)
    assert counter == Counter({reason: 1})
    return info.value


def test_round_trip_and_canonical_digest(group):
    manifest = make_manifest(group)
    signed = seal(manifest, group[:3])
    wire = signed.to_bytes()
    parsed = SignedManifest.from_bytes(wire)
    assert parsed == signed and parsed.to_bytes() == wire
    assert parsed.manifest.digest() == manifest.digest() and len(manifest.digest()) == 64
    # the digest covers the content only, not the signatures or the JSON layout
    pretty = json.dumps(json.loads(wire), indent=2).encode()
    assert SignedManifest.from_bytes(pretty).manifest.digest() == manifest.digest()
    assert verify_manifest(wire, run_id=RUN) == manifest


def test_the_same_bytes_are_parsed_once_and_each_caller_gets_its_own_copy(group, monkeypatch):
    """A peer takes a gossiped manifest apart five times (its check, the index announcement, storing it, the
    sealing group, the newest); each parse verifies every receipt. The bytes are parsed once; an edit of one
    caller's copy (a test forging a signature) reaches no other caller; refused bytes are never kept."""
    manifest = make_manifest(group, step=777)
    wire = seal(manifest, group[:3]).to_bytes()
    parses: list[bytes] = []
    parse = SignedManifest._parse.__func__
    monkeypatch.setattr(
        SignedManifest, "_parse", classmethod(lambda cls, data: parses.append(data) or parse(cls, data))
    )
    first = SignedManifest.from_bytes(wire)
    first.signatures[group[0].peer_id] = "00" * 64
    first.manifest.metrics["num_samples"] = 1
    first.manifest.contributions["someone"] = 1
    second = SignedManifest.from_bytes(bytearray(wire))
    assert len(parses) == 1
    assert second == seal(manifest, group[:3]) and second.to_bytes() == wire
    assert verify_manifest(wire, run_id=RUN) == manifest
    assert len(parses) == 1
    bad = wire.replace(b'"step":777', b'"step":-1')
    assert bad != wire
    for _ in range(2):
        with pytest.raises(ManifestRejected):
            SignedManifest.from_bytes(bad)
    assert len(parses) == 3


def test_sealed_with_default_quorum_and_explicit_quorum(group):
    assert default_quorum(4) == 3 and default_quorum(1) == 2 and default_quorum(5) == 3
    manifest = make_manifest(group)
    assert verify_manifest(seal(manifest, group[:3]), run_id=RUN, is_known_signer=lambda p: True) == manifest
    assert verify_manifest(seal(manifest, group[:1]), run_id=RUN, quorum=1) == manifest


def test_bad_signature(group):
    signed = seal(make_manifest(group), group[:3])
    peer_id, sig = next(iter(signed.signatures.items()))
    flipped = sig[:10] + ("0" if sig[10] != "0" else "1") + sig[11:]
    rejected(signed.with_signature(peer_id, flipped), reason="bad signature")


def test_signature_of_another_manifest_is_bad(group):
    signed = seal(make_manifest(group), group[:3])
    other_sig = sign_manifest(make_manifest(group, step=11), group[0])
    rejected(signed.with_signature(*other_sig), reason="bad signature")


def test_tampered_content_breaks_every_signature(group):
    signed = seal(make_manifest(group), group[:3])
    obj = json.loads(signed.to_bytes())
    obj["manifest"]["metrics"]["val_loss_micro"] = 1
    rejected(json.dumps(obj).encode(), reason="bad signature")


def test_missing_signature(group):
    rejected(SignedManifest(manifest=make_manifest(group)), reason="missing signature")


def test_signer_not_a_participant(group):
    outsider = Identity.generate()
    signed = seal(make_manifest(group), group[:3])
    rejected(signed.with_signature(*sign_manifest(signed.manifest, outsider)), reason="signer not a participant")


def test_unknown_signer(group):
    banned = group[1].peer_id
    rejected(seal(make_manifest(group), group[:3]), reason="unknown signer", is_known_signer=lambda p: p != banned)


def test_below_quorum(group):
    err = rejected(seal(make_manifest(group), group[:2]), reason="below quorum")
    assert "2 valid signatures, 3 needed" in str(err)
    rejected(seal(make_manifest(group), group[:3]), reason="below quorum", quorum=4)


def test_participant_that_is_not_an_ed25519_peer_id_cannot_sign(group):
    fake = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    manifest = replace(make_manifest(group), participants=tuple(sorted([*(i.peer_id for i in group), fake])))
    rejected(seal(manifest, group[:3]).with_signature(fake, "00" * 64), reason="bad signature")


def test_another_runs_manifest(group):
    theirs = seal(make_manifest(group, run_id="run-b"), group)
    rejected(theirs, reason="another run's manifest")
    rejected(theirs.to_bytes(), reason="another run's manifest")


def test_signature_made_for_another_run_does_not_verify(group):
    manifest = make_manifest(group)
    signed = SignedManifest(manifest=manifest)
    for identity in group[:3]:
        sig = identity.sign(kind=MANIFEST_KIND, run_id="run-b", payload=manifest.payload())
        signed = signed.with_signature(identity.peer_id, sig.hex())
    rejected(signed, reason="bad signature")


def test_domain_separation(group):
    manifest, identity = make_manifest(group), group[0]
    _, sig_hex = sign_manifest(manifest, identity)
    sig, payload, key = bytes.fromhex(sig_hex), manifest.payload(), identity.public_key
    assert verify(public_key=key, kind=MANIFEST_KIND, run_id=RUN, payload=payload, signature=sig)
    assert not verify(public_key=key, kind=MANIFEST_KIND, run_id="run-b", payload=payload, signature=sig)
    assert not verify(public_key=key, kind="swarm/record", run_id=RUN, payload=payload, signature=sig)
    assert not verify(public_key=key, kind=BINDING_KIND, run_id="", payload=payload, signature=sig)
    # and a signature over the same bytes made for another kind of object is no manifest signature
    signed = SignedManifest(manifest=manifest)
    for member in group[:3]:
        record_sig = member.sign(kind="swarm/record", run_id=RUN, payload=payload)
        signed = signed.with_signature(member.peer_id, record_sig.hex())
    rejected(signed, reason="bad signature")


def test_replays_are_refused(group):
    old = make_manifest(group, step=10)
    current = make_manifest(group, step=20, parent=old.digest())
    rejected(seal(old, group[:3]), reason="replayed old manifest", previous=current)
    conflicting = replace(current, created_at=current.created_at + 1)
    rejected(seal(conflicting, group[:3]), reason="conflicting manifest for step", previous=current)
    # the same manifest again is fine (a re-announcement), and a newer one descends from it
    assert verify_manifest(seal(current, group[:3]), run_id=RUN, previous=current) == current
    newer = make_manifest(group, step=30, parent=current.digest())
    assert verify_manifest(seal(newer, group[:3]), run_id=RUN, previous=current, require_parent=True) == newer
    orphan = make_manifest(group, step=30, parent=old.digest())
    assert verify_manifest(seal(orphan, group[:3]), run_id=RUN, previous=current) == orphan
    rejected(seal(orphan, group[:3]), reason="broken lineage", previous=current, require_parent=True)


def test_oversized(group):
    signed = seal(make_manifest(group), group[:3])
    padded = signed.to_bytes() + b" " * (MAX_MANIFEST_BYTES + 1 - len(signed.to_bytes()))
    rejected(padded, reason="oversized")


def _mutations(group) -> dict[str, bytes]:
    good = json.loads(seal(make_manifest(group), group[:3]).to_bytes())

    def mutated(edit) -> bytes:
        obj = json.loads(json.dumps(good))
        edit(obj)
        return json.dumps(obj).encode()

    m = "manifest"
    return {
        "not json": b"{not json",
        "not utf8": b"\xff\xfe{}",
        "top level list": b"[]",
        "float step": mutated(lambda o: o[m].update(step=1.5)),
        "float metric": mutated(lambda o: o[m]["metrics"].update(val_loss=2.31)),
        "string step": mutated(lambda o: o[m].update(step="10")),
        "bool step": mutated(lambda o: o[m].update(step=True)),
        "negative step": mutated(lambda o: o[m].update(step=-1)),
        "huge int": mutated(lambda o: o[m].update(created_at=2**70)),
        "extra field": mutated(lambda o: o[m].update(extra=1)),
        "extra top field": mutated(lambda o: o.update(note="hi")),
        "missing field": mutated(lambda o: o[m].pop("parent")),
        "bad parent": mutated(lambda o: o[m].update(parent="xyz")),
        "uppercase digest": mutated(lambda o: o[m]["shards"][0].update(digest="AB" * 32)),
        "float64 dtype": mutated(lambda o: o[m]["shards"][0]["tensors"][0].update(dtype="float64")),
        "float in shape": mutated(lambda o: o[m]["shards"][0]["tensors"][0].update(shape=[4.0, 4])),
        "shape not list": mutated(lambda o: o[m]["shards"][0]["tensors"][0].update(shape="4x4")),
        "shard extra field": mutated(lambda o: o[m]["shards"][0].update(url="http://x")),
        "unsorted participants": mutated(lambda o: o[m]["participants"].reverse()),
        "duplicate participant": mutated(lambda o: o[m]["participants"].append(o[m]["participants"][-1])),
        "participants not list": mutated(lambda o: o[m].update(participants="a")),
        "short signature": mutated(lambda o: o["signatures"].update({group[0].peer_id: "00"})),
        "signature not str": mutated(lambda o: o["signatures"].update({group[0].peer_id: 7})),
        "signatures not object": mutated(lambda o: o.update(signatures=[])),
        "empty run id": mutated(lambda o: o[m].update(run_id="")),
        "NaN": json.dumps(good).replace('"step": 10', '"step": NaN').encode(),
        "duplicate key": json.dumps(good).replace('"step": 10', '"step": 10, "step": 11').encode(),
    }


MALFORMED_CASES = [
    "not json",
    "not utf8",
    "top level list",
    "float step",
    "float metric",
    "string step",
    "bool step",
    "negative step",
    "huge int",
    "extra field",
    "extra top field",
    "missing field",
    "bad parent",
    "uppercase digest",
    "float64 dtype",
    "float in shape",
    "shape not list",
    "shard extra field",
    "unsorted participants",
    "duplicate participant",
    "participants not list",
    "short signature",
    "signature not str",
    "signatures not object",
    "empty run id",
    "NaN",
    "duplicate key",
]


@pytest.mark.parametrize("case", MALFORMED_CASES)
def test_malformed(group, case):
    cases = _mutations(group)
    assert sorted(cases) == sorted(MALFORMED_CASES)
    data = cases[case]
    assert data != seal(make_manifest(group), group[:3]).to_bytes()
    rejected(data, reason="malformed")


def test_unsupported_version(group):
    obj = json.loads(seal(make_manifest(group), group[:3]).to_bytes())
    obj["manifest"]["version"] = 2
    rejected(json.dumps(obj).encode(), reason="unsupported version")


@settings(max_examples=150, deadline=None)
@given(data=st.binary(max_size=512))
def test_fuzzed_bytes_only_raise_manifest_rejected(data):
    with pytest.raises(ManifestRejected):
        verify_manifest(data, run_id=RUN, counter=Counter())


def test_random_byte_corruption_never_verifies(group):
    seed = random.randrange(2**32)
    print(f"seed={seed}")
    rng = random.Random(seed)
    wire = bytearray(seal(make_manifest(group), group[:3]).to_bytes())
    for _ in range(300):
        corrupt = bytearray(wire)
        position = rng.randrange(len(corrupt))
        corrupt[position] ^= 1 << rng.randrange(8)
        counter: Counter[str] = Counter()
        try:
            verify_manifest(bytes(corrupt), run_id=RUN, counter=counter)
        except ManifestRejected:
            assert sum(counter.values()) == 1
            continue
        pytest.fail(f"seed={seed}: a flip at byte {position} still verified")


def test_manifest_construction_refuses_bad_values(group):
    good = make_manifest(group)
    with pytest.raises(ValueError, match="metric"):
        replace(good, metrics={"val_loss": 2.31})
    with pytest.raises(ValueError, match="participants must be sorted"):
        replace(good, participants=tuple(reversed(good.participants)))
    with pytest.raises(ValueError, match="config_digest"):
        replace(good, config_digest="00")
    with pytest.raises(ValueError, match="more than one shard"):
        replace(good, shards=(good.shards[0], replace(good.shards[0], digest="cd" * 32)))


def test_public_key_from_peer_id(group):
    for identity in group:
        assert public_key_from_peer_id(identity.peer_id) == identity.public_key
    for bad in ["", "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", "0OIl", "1" * 200, group[0].peer_id[:-1], None]:
        with pytest.raises(ValueError):
            public_key_from_peer_id(bad)


def _chain(group, length: int = 5) -> list[Manifest]:
    chain = [make_manifest(group, step=1)]
    for step in range(2, length + 1):
        chain.append(make_manifest(group, step=step * 10, parent=chain[-1].digest()))
    return chain


def test_lineage_of_five(group):
    chain = _chain(group)
    verify_lineage(chain)
    verify_lineage(chain[2:], root_parent=chain[1].digest())


def test_lineage_broken_link(group):
    chain = _chain(group)
    chain[3] = replace(chain[3], parent=chain[1].digest())
    with pytest.raises(ManifestRejected) as info:
        verify_lineage(chain)
    assert info.value.reason == "broken lineage"
    with pytest.raises(ManifestRejected, match="broken lineage"):
        verify_lineage(_chain(group)[1:])  # does not start at genesis


def test_lineage_steps_must_increase(group):
    first = make_manifest(group, step=10)
    second = make_manifest(group, step=10, parent=first.digest())
    with pytest.raises(ManifestRejected) as info:
        verify_lineage([first, second])
    assert info.value.reason == "steps not increasing"


def test_lineage_of_mixed_runs(group):
    first = make_manifest(group, step=1)
    second = make_manifest(group, step=2, parent=first.digest(), run_id="run-b")
    with pytest.raises(ManifestRejected) as info:
        verify_lineage([first, second])
    assert info.value.reason == "another run's manifest"
