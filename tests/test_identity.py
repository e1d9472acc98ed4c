"""Identity keys: creation, reload, unsafe modes, corrupt files, and domain separation of signatures."""

import os
import stat
import subprocess
import sys

import pytest

from bootstrap.identity import Identity, IdentityError, PeerBinding, canonical_json, verify


def test_create_then_reload_gives_the_same_key(tmp_path):
    path = tmp_path / "sub" / "identity.key"
    first = Identity.load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    second = Identity.load_or_create(path)
    assert first.public_key == second.public_key and len(first.public_key) == 32


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660])
def test_group_or_world_readable_key_is_refused_and_left_alone(tmp_path, mode):
    path = tmp_path / "identity.key"
    Identity.load_or_create(path)
    before = path.read_bytes()
    os.chmod(path, mode)
    with pytest.raises(IdentityError, match="accessible by other users"):
        Identity.load_or_create(path)
    assert path.read_bytes() == before


@pytest.mark.parametrize("contents", [b"", b"garbage", b"swarm-ed25519-v1\n" + b"zz" * 32 + b"\n", b"\x00" * 82])
def test_corrupt_key_is_refused_and_not_overwritten(tmp_path, contents):
    path = tmp_path / "identity.key"
    path.write_bytes(contents)
    os.chmod(path, 0o600)
    with pytest.raises(IdentityError, match="corrupt"):
        Identity.load_or_create(path)
    assert path.read_bytes() == contents


def test_unreadable_key_is_a_clear_error(tmp_path):
    path = tmp_path / "identity.key"
    path.mkdir(mode=0o700)
    with pytest.raises(IdentityError, match="not a regular file"):
        Identity.load_or_create(path)


def test_signature_verifies_only_in_its_own_domain_and_run():
    ident = Identity.generate()
    payload = canonical_json({"step": 3, "who": "me"})
    sig = ident.sign(kind="swarm/manifest", run_id="run-a", payload=payload)
    ok = dict(public_key=ident.public_key, payload=payload, signature=sig)
    assert verify(kind="swarm/manifest", run_id="run-a", **ok)
    assert not verify(kind="swarm/record", run_id="run-a", **ok)
    assert not verify(kind="swarm/manifest", run_id="run-b", **ok)
    assert not verify(
        kind="swarm/manifest", run_id="run-a", public_key=ident.public_key, payload=payload + b" ", signature=sig
    )
    assert not verify(
        kind="swarm/manifest", run_id="run-a", public_key=Identity.generate().public_key, payload=payload, signature=sig
    )
    # the separator cannot be smuggled in to make two domains collide
    with pytest.raises(ValueError):
        ident.sign(kind="swarm/manifest\x00run-a", run_id="", payload=payload)


@pytest.mark.parametrize("bad", [b"", b"x" * 63, b"x" * 65, "not-bytes", None])
def test_verify_never_raises_on_malformed_signatures(bad):
    ident = Identity.generate()
    assert not verify(kind="k", run_id="r", public_key=ident.public_key, payload=b"p", signature=bad)
    assert not verify(kind="k", run_id="r", public_key=bad, payload=b"p", signature=b"x" * 64)


def test_binding_round_trip_and_tampering():
    ident = Identity.generate()
    binding = ident.bind(ident.peer_id)
    assert binding.is_valid()
    assert not ident.bind("QmSomeoneElse").is_valid(), "a key can only speak for the peer ID it derives"
    parsed = PeerBinding.from_dict(binding.to_dict())
    assert parsed == binding and parsed.is_valid()
    other = Identity.generate()
    stolen = PeerBinding(peer_id=other.peer_id, public_key=binding.public_key, signature=binding.signature)
    assert not stolen.is_valid()
    forged = other.bind(ident.peer_id)  # validly signed, but by a key that is not ident's
    assert not forged.is_valid()
    for bad in [None, {}, {"peer_id": "x", "public_key": "zz", "signature": "00"}, [1, 2]]:
        with pytest.raises(ValueError):
            PeerBinding.from_dict(bad)


def test_canonical_json_is_deterministic_and_refuses_floats():
    assert canonical_json({"b": 1, "a": [2, "x"]}) == b'{"a":[2,"x"],"b":1}'
    with pytest.raises(TypeError):
        canonical_json({"loss": 0.5})


def test_peer_id_is_the_libp2p_id_of_the_key(tmp_path):
    from bootstrap.node import check_identity_file

    ident = Identity.generate()
    assert ident.peer_id.startswith("12D3KooW")
    with ident.libp2p_identity_file() as path:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert str(check_identity_file(path)) == ident.peer_id
    assert not os.path.exists(path)


def test_a_key_in_use_by_a_live_peer_is_refused(tmp_path):
    path = tmp_path / "identity.key"
    Identity.load_or_create(path).lock()  # held by this (test) process until it exits
    code = f"from bootstrap.identity import Identity; Identity.load_or_create({str(path)!r}).lock()"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "in use by another running peer" in out.stderr
