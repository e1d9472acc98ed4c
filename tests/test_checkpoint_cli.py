"""`python -m swarm.checkpoint list|show|verify|export` on a store holding a chain of sealed manifests."""

import pytest
import torch
from safetensors.torch import load_file

from bootstrap.identity import Identity
from swarm.checkpoint import CheckpointStore, Manifest, SignedManifest, sign_manifest
from swarm.checkpoint.__main__ import main


@pytest.fixture
def sealed_store(tmp_path):
    store = CheckpointStore(tmp_path / "store", keep_last=5)
    signers = [Identity.generate(), Identity.generate(), Identity.generate()]
    parent = ""
    for step in (1, 2, 3):
        state = {"param/w": torch.full((4, 4), float(step)), "momentum/w": torch.zeros(4, 4)}
        manifest = Manifest(
            version=1,
            run_id="cli",
            step=step,
            round=step,
            task="charlm",
            config_digest="c" * 64,
            parent=parent,
            shards=tuple(store.put_tensors(state)),
            participants=tuple(sorted(s.peer_id for s in signers)),
            metrics={},
            created_at=1_800_000_000 + step,
        )
        signed = SignedManifest(manifest=manifest, signatures={})
        for signer in signers:
            signed = signed.with_signature(*sign_manifest(manifest, signer))
        parent = store.put_manifest(signed.to_bytes())
    return store, tmp_path / "store"


def test_list_show_verify_export(sealed_store, tmp_path, capsys):
    store, folder = sealed_store
    assert main(["list", "--dir", str(folder)]) == 0
    assert main(["show", "--dir", str(folder)]) == 0
    assert main(["verify", "--dir", str(folder)]) == 0
    assert "lineage of 3 manifest(s) intact" in " ".join(capsys.readouterr().out.split())
    out = tmp_path / "model.safetensors"
    assert main(["export", "--dir", str(folder), "--out", str(out)]) == 0
    exported = load_file(out)
    assert set(exported) == {"w"} and torch.equal(exported["w"], torch.full((4, 4), 3.0))


def test_verify_fails_on_a_corrupt_shard_or_a_bad_signature(sealed_store, capsys):
    store, folder = sealed_store
    newest = store.list_manifests()[-1]
    signed = SignedManifest.from_bytes(store.get_manifest(newest))
    shard = store.shard_path(signed.manifest.shards[0].digest)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    assert main(["verify", "--dir", str(folder)]) == 1
    assert "digest mismatch" in " ".join(capsys.readouterr().out.split())
    # a forged signature on an older manifest of the chain breaks verification of that manifest
    older = store.list_manifests()[1]
    forged = SignedManifest.from_bytes(store.get_manifest(older))
    peer = next(iter(forged.signatures))
    forged.signatures[peer] = "00" * 64
    (folder / "manifests" / f"{older}.json").write_bytes(forged.to_bytes())
    assert main(["verify", "--dir", str(folder), "--manifest", older[:12]]) == 1


def test_verify_takes_the_newest_checkpoint_held_whole(sealed_store, tmp_path, capsys):
    """A store also keeps manifests learned by gossip without their shards; by default `verify` checks the
    newest one whose shards it holds, and a manifest named explicitly must have them all."""
    store, folder = sealed_store
    elsewhere = CheckpointStore(tmp_path / "elsewhere")
    signers = [Identity.generate(), Identity.generate()]
    manifest = Manifest(
        version=1,
        run_id="cli",
        step=4,
        round=4,
        task="charlm",
        config_digest="c" * 64,
        parent=store.list_manifests()[-1],
        shards=tuple(elsewhere.put_tensors({"param/w": torch.full((4, 4), 4.0)})),
        participants=tuple(sorted(s.peer_id for s in signers)),
        metrics={},
        created_at=1_800_000_004,
    )
    signed = SignedManifest(manifest=manifest, signatures={})
    for signer in signers:
        signed = signed.with_signature(*sign_manifest(manifest, signer))
    gossiped = store.put_manifest(signed.to_bytes())  # the manifest only, as gossip delivers it
    assert store.list_manifests()[-1] == gossiped
    assert main(["verify", "--dir", str(folder)]) == 0
    assert "step 3" in " ".join(capsys.readouterr().out.split())
    assert main(["verify", "--dir", str(folder), "--manifest", gossiped[:12]]) == 1
    assert "fetch it from a donor first" in " ".join(capsys.readouterr().out.split())


def test_list_on_a_folder_with_no_checkpoint_says_so_and_exits_1(tmp_path, capsys):
    assert main(["list", "--dir", str(tmp_path)]) == 1
    assert f"no sealed checkpoint in {tmp_path}" in " ".join(capsys.readouterr().out.split())
