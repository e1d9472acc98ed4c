"""Identity keys: creation, reload, unsafe modes, corrupt files, and domain separation of signatures."""

import os
import stat

import pytest

from swarm.identity import Identity, IdentityError, PeerBinding, canonical_json, verify


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
    assert not verify(kind="swarm/manifest", run_id="run-a", public_key=ident.public_key,
                      payload=payload + b" ", signature=sig)
    assert not verify(kind="swarm/manifest", run_id="run-a", public_key=Identity.generate().public_key,
                      payload=payload, signature=sig)
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
    binding = ident.bind("QmPeer")
    assert binding.is_valid()
    parsed = PeerBinding.from_dict(binding.to_dict())
    assert parsed == binding and parsed.is_valid()
    stolen = PeerBinding(peer_id="QmOther", public_key=binding.public_key, signature=binding.signature)
    assert not stolen.is_valid()
    for bad in [None, {}, {"peer_id": "x", "public_key": "zz", "signature": "00"}, [1, 2]]:
        with pytest.raises(ValueError):
            PeerBinding.from_dict(bad)


def test_canonical_json_is_deterministic_and_refuses_floats():
    assert canonical_json({"b": 1, "a": [2, "x"]}) == b'{"a":[2,"x"],"b":1}'
    with pytest.raises(TypeError):
        canonical_json({"loss": 0.5})
