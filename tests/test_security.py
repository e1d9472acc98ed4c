"""Security checks (issue 8 item 4; TESTMATRIX rows 12-14 and 19): keys, pickle, domains, replays, stolen IDs.

Many checks already live beside the code they test; this module adds the missing ones. The table maps
every check to the test that covers it (``this`` = this module).

| check | covered by |
|---|---|
| identity key readable by group/others: refused, file left alone | test_identity::test_group_or_world_readable_key_is_refused_and_left_alone; test_cli::test_bad_identity_key_is_refused_and_left_alone (peer CLI exits 2) |
| corrupt identity key: refused, never overwritten | test_identity::test_corrupt_key_is_refused_and_not_overwritten; this::test_a_key_with_a_whitespace_padded_short_seed_is_corrupt; test_fuzz::test_identity_key_loading_refuses_clearly_and_never_rewrites |
| a key that appears while one is being created is not overwritten | this::test_creating_a_key_never_overwrites_an_existing_file |
| symlinked key: dangling refused (no file made), to an open file refused | this::test_a_symlinked_key_is_followed_only_to_a_private_file |
| new key 0600 in a 0700 folder; p2pd's copy 0600 and removed | test_identity::test_create_then_reload_gives_the_same_key, ::test_peer_id_is_the_libp2p_id_of_the_key |
| bootstrap node key open to others: refused | test_bootstrap::test_identity_file_open_to_others_is_refused |
| one key used by two live peers: refused | test_identity::test_a_key_in_use_by_a_live_peer_is_refused |
| pickle / torch.save file placed as a shard: refused, never run | test_checkpoint_store::test_pickle_placed_as_a_shard_is_refused_and_never_run |
| a sealed checkpoint whose shard is a pickle: `verify` / `export` refuse it | this::test_a_checkpoint_with_a_pickled_shard_is_refused_by_the_cli |
| pickle bytes inside a valid safetensors file stay inert data | this::test_pickle_bytes_inside_a_safetensors_shard_are_never_unpickled |
| .pt / .pkl files in the store are never read | this::test_pt_and_pickle_files_in_the_store_are_never_read |
| nothing in swarm/, peers/, averaging/, bootstrap/ calls torch.load, pickle & co | this::test_no_source_file_loads_pickle (scanner checked by ::test_the_pickle_scanner_catches_every_form) |
| a signature for kind A / run R verifies as no other kind / run: records, statuses, receipts, manifests, ledger entries, bindings | this::test_a_signature_verifies_only_for_its_own_kind_and_run (all 6 x 18 domains); partly test_identity, test_manifest::test_domain_separation, test_peers::test_forged_records_are_rejected, test_status::test_forged_foreign_and_replayed_statuses_are_refused_and_counted, test_ledger (receipt "signed for another kind") |
| replayed record: expired, or kept alive past its expiry | test_peers::test_expired_future_and_overlong_records_are_rejected, ::test_no_peer_can_overwrite_replay_or_withdraw_another_peers_record |
| replayed older (still valid) record loses to the newer one in a live DHT | this::test_a_replayed_older_record_never_replaces_the_newer_one |
| replayed receipt: another run | test_ledger::test_receipt_rejections_are_counted_by_reason ("wrong run") |
| replayed receipt: an old round's or another run's receipt attached to a manifest | this::test_old_or_foreign_receipts_in_a_manifest_are_refused |
| replayed receipt in the group's receipt swap (direct posts or the DHT) | this::test_a_replayed_receipt_is_not_taken_in_the_receipt_swap |
| a group post (seal signature, receipt) under another's peer ID, garbage, or a flood | test_posts (filed under the caller's authenticated peer ID; each refusal reason counted; a flood pushes out only the flooder's own posts) |
| replayed manifest: older step, conflicting, another run, signature for another run | test_manifest::test_replays_are_refused, ::test_another_runs_manifest, ::test_signature_made_for_another_run_does_not_verify; test_gossip (an old manifest is not forwarded) |
| replayed status: stale or from the future | test_status::test_forged_foreign_and_replayed_statuses_are_refused_and_counted |
| replayed ledger entries (another run's, or an old one re-appended) | this::test_replayed_ledger_entries_are_blamed |
| another's peer ID: capability record | test_peers::test_forged_records_are_rejected, ::test_no_peer_can_overwrite_replay_or_withdraw_another_peers_record |
| another's peer ID: status entry | test_status::test_forged_foreign_and_replayed_statuses_are_refused_and_counted ("peer mismatch", "bad signature") |
| another's peer ID: receipt | test_ledger::test_receipt_rejections_are_counted_by_reason ("signed by another key for the peer") |
| another's peer ID: manifest signature (to inflate the quorum) | this::test_a_participant_cannot_sign_a_manifest_for_another |
| another's peer ID: ledger opened or re-signed by another identity | test_ledger::test_opening_another_peers_or_runs_ledger_is_refused, ::test_a_chain_resigned_by_another_key_is_refused |
| another's peer ID: binding | test_identity::test_binding_round_trip_and_tampering |
| another's peer ID: a group member's metadata binding | this::test_group_metadata_with_a_borrowed_binding_is_rejected |
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import io
import os
import pickle
import sqlite3
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save as safetensors_save

from bootstrap import stop_dht
from bootstrap.identity import BINDING_KIND, Identity, IdentityError, PeerBinding, _create_key_file
from bootstrap.network import start_swarm_dht
from bootstrap.records import RECORD_KIND, RecordRejected, parse_record, sign_record
from peers import ResourceGraph, dht_record_rejections, peers_key
from peers.testing import make_record
from swarm.checkpoint import CheckpointStore, Manifest, ShardInfo, SignedManifest, TensorInfo
from swarm.checkpoint.__main__ import main as checkpoint_cli
from swarm.checkpoint.manifest import MANIFEST_KIND, ManifestRejected, sign_manifest, verify_manifest
from swarm.checkpoint.sync import _ReceiptSwap
from swarm.ledger import (
    LEDGER_KIND,
    RECEIPT_KIND,
    Ledger,
    Receipt,
    ReceiptRejected,
    sign_receipt,
    verify_ledger,
    verify_receipt,
)
from swarm.rounds import gathered_problem as _gathered_problem
from swarm.status import STATUS_KIND, PeerStatus, StatusRejected, parse_status
from tests.helpers import parse_python, wait_until

RUN, OTHER_RUN = "sec-run", "sec-other-run"
REPO = Path(__file__).resolve().parents[1]
SOURCE_PACKAGES = ("swarm", "peers", "averaging", "bootstrap")


# ================================================================================================ identity keys
KEY_MAGIC = b"swarm-ed25519-v1\n"


def test_a_key_with_a_whitespace_padded_short_seed_is_corrupt(tmp_path):
    # bytes.fromhex skips whitespace: a file of the right length could hold a 31-byte seed, which once
    # escaped as nacl's ValueError (a traceback instead of the "corrupt key" error the CLI turns into exit 2)
    path = tmp_path / "identity.key"
    contents = KEY_MAGIC + b"ab" * 31 + b"  \n"
    path.write_bytes(contents)
    os.chmod(path, 0o600)
    with pytest.raises(IdentityError, match=r"corrupt \(31-byte seed\)"):
        Identity.load_or_create(path)
    assert path.read_bytes() == contents


def test_creating_a_key_never_overwrites_an_existing_file(tmp_path):
    path = tmp_path / "identity.key"
    original = Identity.load_or_create(path)
    contents = path.read_bytes()
    # a second creator that lost the race (the file appeared after its existence check) must fail, not overwrite
    with pytest.raises(IdentityError, match="cannot create identity key"):
        _create_key_file(path)
    assert path.read_bytes() == contents
    assert Identity.load_or_create(path).public_key == original.public_key


def test_a_symlinked_key_is_followed_only_to_a_private_file(tmp_path):
    dangling = tmp_path / "dangling.key"
    dangling.symlink_to(tmp_path / "nowhere" / "identity.key")
    with pytest.raises(IdentityError, match="cannot read identity key"):
        Identity.load_or_create(dangling)
    assert not (tmp_path / "nowhere").exists(), "a dangling link must not make a key where it points"

    shared = tmp_path / "shared.key"
    Identity.load_or_create(shared)
    link = tmp_path / "link.key"
    link.symlink_to(shared)
    assert Identity.load_or_create(link).public_key == Identity.load_or_create(shared).public_key
    os.chmod(shared, 0o644)
    with pytest.raises(IdentityError, match="accessible by other users"):
        Identity.load_or_create(link)


# ================================================================================================ pickle-free loading
class _Exploit:
    """Unpickling this creates a marker directory: proof that pickle ran."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


@pytest.fixture
def no_pickle(monkeypatch):
    """torch.load and pickle's loaders raise if anything calls them; yields the list of attempted calls."""
    attempts: list[str] = []

    def forbidden(name: str):
        def call(*args, **kwargs):
            attempts.append(name)
            raise AssertionError(f"{name} must never be called")

        return call

    monkeypatch.setattr(torch, "load", forbidden("torch.load"))
    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, forbidden(f"pickle.{name}"))
    return attempts


def _signers() -> list[Identity]:
    return sorted((Identity.generate() for _ in range(2)), key=lambda i: i.peer_id)


def _sealed(manifest: Manifest, signers: list[Identity]) -> SignedManifest:
    signed = SignedManifest(manifest=manifest)
    for signer in signers:
        signed = signed.with_signature(*sign_manifest(manifest, signer))
    return signed


@pytest.mark.parametrize("kind", ["torch.save", "raw pickle"])
def test_a_checkpoint_with_a_pickled_shard_is_refused_by_the_cli(tmp_path, no_pickle, capsys, kind):
    marker = tmp_path / "pwned"
    if kind == "torch.save":
        buffer = io.BytesIO()
        torch.save({"param/w": torch.ones(3), "evil": _Exploit(str(marker))}, buffer)
        data = buffer.getvalue()
    else:
        data = pickle.dumps({"param/w": _Exploit(str(marker))})
    store = CheckpointStore(tmp_path / "ckpt")
    digest = hashlib.sha256(data).hexdigest()
    store.shard_path(digest).write_bytes(data)  # named by its own digest: only the format can give it away
    signers = _signers()
    shard = ShardInfo(
        name="shard-00000",
        digest=digest,
        size_bytes=len(data),
        tensors=(TensorInfo(name="param/w", dtype="float32", shape=(3,)),),
    )
    manifest = Manifest(
        run_id=RUN,
        step=1,
        round=1,
        task="charlm",
        config_digest="ab" * 32,
        parent="",
        shards=(shard,),
        participants=tuple(s.peer_id for s in signers),
        created_at=1_800_000_000,
    )
    store.put_manifest(_sealed(manifest, signers).to_bytes())
    out = tmp_path / "model.safetensors"
    for argv in (["verify", "--dir", str(store.root)], ["export", "--dir", str(store.root), "--out", str(out)]):
        assert checkpoint_cli(argv) == 1
        printed = " ".join(capsys.readouterr().out.split())
        assert "verification failed" in printed and "pickle is never loaded" in printed, printed
    assert not out.exists() and not marker.exists() and no_pickle == []


def test_pickle_bytes_inside_a_safetensors_shard_are_never_unpickled(tmp_path, no_pickle):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Exploit(str(marker)))
    store = CheckpointStore(tmp_path / "ckpt")
    (shard,) = store.put_tensors({"blob": torch.frombuffer(bytearray(payload), dtype=torch.uint8)})
    assert bytes(store.load_tensors(shard)["blob"].numpy()) == payload  # data, returned as data
    # the same bytes as header metadata (which safetensors returns as strings, never decodes)
    data = safetensors_save({"w": torch.ones(2)}, metadata={"evil": payload.decode("latin-1")})
    digest = hashlib.sha256(data).hexdigest()
    store.put_shard_bytes(data, expected_digest=digest)
    info = ShardInfo(
        name="s", digest=digest, size_bytes=len(data), tensors=(TensorInfo(name="w", dtype="float32", shape=(2,)),)
    )
    assert torch.equal(store.load_tensors(info)["w"], torch.ones(2))
    assert not marker.exists() and no_pickle == [] and not store.rejected


def test_pt_and_pickle_files_in_the_store_are_never_read(tmp_path, no_pickle):
    marker = tmp_path / "pwned"
    store = CheckpointStore(tmp_path / "ckpt")
    data = pickle.dumps(_Exploit(str(marker)))
    digest = hashlib.sha256(data).hexdigest()
    for folder, suffix in ((store.shards_dir, ".pt"), (store.shards_dir, ".pkl"), (store.manifests_dir, ".pt")):
        (folder / f"{digest}{suffix}").write_bytes(data)
    assert not store.has(digest) and store.list_manifests() == []
    with pytest.raises(FileNotFoundError):
        store.read_shard(digest)
    assert store.prune().removed_shards == 0 and not store.rejected
    assert not marker.exists() and no_pickle == []


_PICKLE_MODULES = frozenset({"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"})
_UNSAFE_CALLS = frozenset(
    {"torch.load", "torch.serialization.load", "torch.jit.load", "pandas.read_pickle", "numpy.load+allow_pickle"}
)


def unsafe_loads(source: str, filename: str = "<source>") -> list[str]:
    """Every import of a pickle-like module and every call of an unpickling loader in ``source``."""
    tree = parse_python(source, filename)
    aliases: dict[str, str] = {}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                aliases[alias.asname or top] = alias.name if alias.asname else top
                if top in _PICKLE_MODULES:
                    found.append(f"{filename}:{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{module}.{alias.name}"
            if module.split(".")[0] in _PICKLE_MODULES:
                found.append(f"{filename}:{node.lineno}: from {module} import ...")
    for node in ast.walk(tree):
        if isinstance(node, (ast.Name, ast.Attribute)) and _dotted(node, aliases).endswith("PickleSerializer"):
            found.append(f"{filename}:{node.lineno}: PickleSerializer")
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func, aliases)
        if name == "numpy.load" and any(
            kw.arg == "allow_pickle" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False)
            for kw in node.keywords
        ):
            name += "+allow_pickle"
        if name in _UNSAFE_CALLS:
            found.append(f"{filename}:{node.lineno}: {name}(...)")
    return found


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return ""
    return ".".join([aliases.get(node.id, node.id), *reversed(parts)])


def test_the_pickle_scanner_catches_every_form():
    unsafe = {
        "import pickle": 1,
        "import dill as d": 1,
        "from marshal import loads": 1,
        "import torch\ntorch.load(f)": 1,
        "import torch as t\nt.load(f)": 1,
        "from torch import load\nload(f)": 1,
        "from torch import load as l\nl(f)": 1,
        "import torch\ntorch.jit.load(f)": 1,
        "import torch.serialization\ntorch.serialization.load(f)": 1,
        "import numpy as np\nnp.load(f, allow_pickle=True)": 1,
        "from hivemind.utils.serializer import PickleSerializer\nPickleSerializer.loads(b)": 1,
    }
    for source, count in unsafe.items():
        assert len(unsafe_loads(source)) == count, (source, unsafe_loads(source))
    safe = (
        "import torch\ntorch.zeros(3)",
        "import numpy as np\nnp.load(f)",
        "import numpy as np\nnp.load(f, allow_pickle=False)",
        "from safetensors.torch import load\nload(b)",
        "import json\njson.loads(s)",
        "model.load_state_dict(sd)",
    )
    for source in safe:
        assert unsafe_loads(source) == [], source


def test_no_source_file_loads_pickle():
    files = sorted(p for package in SOURCE_PACKAGES for p in (REPO / package).rglob("*.py"))
    assert len(files) > 30, (
        f"only {len(files)} source files found under {REPO}: is the scan looking in the right place?"
    )
    found = [problem for path in files for problem in unsafe_loads(path.read_text(), str(path.relative_to(REPO)))]
    assert found == [], "unpickling loaders in the source:\n" + "\n".join(found)


# ================================================================================================ domain separation
def _domains() -> list[tuple[str, str]]:
    kinds = (RECORD_KIND, STATUS_KIND, RECEIPT_KIND, MANIFEST_KIND, LEDGER_KIND, BINDING_KIND)
    return [(kind, run) for kind in kinds for run in ("", RUN, OTHER_RUN)]


class _Signed:
    """One kind of signed object: its payload, its true domain, and whether a signature makes it valid."""

    def __init__(self, name: str, signer: Identity, tmp_path: Path):
        self.name, self.signer, self.tmp_path = name, signer, tmp_path
        builder = getattr(self, f"_build_{name}")
        self.domain, self.payload, self.accepts = builder()

    def _build_record(self):
        payload = make_record(self.signer).payload()

        def accepts(sig: bytes) -> bool:
            try:
                parse_record(self.signer.peer_id, {"p": payload, "s": sig})
            except RecordRejected as e:
                assert e.reason == "bad signature", e
                return False
            return True

        return (RECORD_KIND, ""), payload, accepts

    def _build_status(self):
        status = PeerStatus(
            peer=self.signer.peer_id,
            run=RUN,
            t=int(time.time()),
            state="training",
            round=1,
            step=1,
            samples_per_s_milli=1,
            loss_milli=None,
            val_loss_milli=None,
            last_group=None,
        )
        payload = status.payload()

        def accepts(sig: bytes) -> bool:
            try:
                parse_status(self.signer.peer_id, {"p": payload, "s": sig}, run=RUN, counter=Counter())
            except StatusRejected as e:
                assert e.reason == "bad signature", e
                return False
            return True

        return (STATUS_KIND, RUN), payload, accepts

    def _build_receipt(self):
        receipt = Receipt(
            run=RUN,
            round=1,
            group_id="g",
            members=(self.signer.peer_id,),
            peer=self.signer.peer_id,
            samples=1,
            bytes_sent=1,
            bytes_received=1,
            ledger_seq=0,
            ledger_head="0" * 64,
            t=1,
        )

        def accepts(sig: bytes) -> bool:
            try:
                verify_receipt({"receipt": receipt.to_dict(), "signature": sig.hex()}, run_id=RUN, counter=Counter())
            except ReceiptRejected as e:
                assert e.reason == "bad signature", e
                return False
            return True

        return (RECEIPT_KIND, RUN), receipt.payload(), accepts

    def _build_manifest(self):
        manifest = Manifest(
            run_id=RUN,
            step=1,
            round=1,
            task="charlm",
            config_digest="ab" * 32,
            parent="",
            shards=(),
            participants=(self.signer.peer_id,),
            created_at=1,
        )

        def accepts(sig: bytes) -> bool:
            signed = SignedManifest(manifest=manifest, signatures={self.signer.peer_id: sig.hex()})
            try:
                verify_manifest(signed, run_id=RUN, quorum=1, counter=Counter())
            except ManifestRejected as e:
                assert e.reason == "bad signature", e
                return False
            return True

        return (MANIFEST_KIND, RUN), manifest.payload(), accepts

    def _build_ledger(self):
        path = self.tmp_path / f"{self.signer.peer_id}.sqlite"
        with Ledger(path, identity=self.signer, run=RUN) as ledger:
            entry = ledger.append("train", {"step": 1})

        def accepts(sig: bytes) -> bool:
            with contextlib.closing(sqlite3.connect(path)) as conn:
                conn.execute("UPDATE entries SET signature = ? WHERE seq = 1", (sig.hex(),))
                conn.commit()
            verdict = verify_ledger(path)
            assert verdict.ok or verdict.problems == [
                "seq 1: signature does not verify: forged, or signed by a key other than the owner's"
            ], verdict
            return verdict.ok

        return (LEDGER_KIND, RUN), bytes.fromhex(entry.digest), accepts

    def _build_binding(self):
        unsigned = PeerBinding(peer_id=self.signer.peer_id, public_key=self.signer.public_key, signature=b"")

        def accepts(sig: bytes) -> bool:
            return PeerBinding(peer_id=self.signer.peer_id, public_key=self.signer.public_key, signature=sig).is_valid()

        return (BINDING_KIND, ""), unsigned.payload(), accepts


@pytest.mark.parametrize("name", ["record", "status", "receipt", "manifest", "ledger", "binding"])
def test_a_signature_verifies_only_for_its_own_kind_and_run(tmp_path, name):
    signed = _Signed(name, Identity.generate(), tmp_path)
    accepted = [
        domain
        for domain in _domains()
        if signed.accepts(signed.signer.sign(kind=domain[0], run_id=domain[1], payload=signed.payload))
    ]
    assert accepted == [signed.domain], f"{name}: signatures accepted for {accepted}"


# ================================================================================================ replays
@pytest.mark.timeout(60)
def test_a_replayed_older_record_never_replaces_the_newer_one():
    peer = Identity.generate()
    dht = start_swarm_dht(Identity.generate(), host_maddrs=("/ip4/127.0.0.1/tcp/0",))
    try:
        now = int(time.time())
        old = sign_record(make_record(peer, seq=7, issued_at=now - 30, lifetime_s=90), peer)  # still valid
        new = sign_record(make_record(peer, seq=8, issued_at=now, lifetime_s=120), peer)
        expired = sign_record(make_record(peer, seq=6, issued_at=now - 200, lifetime_s=100), peer)
        assert dht.store(peers_key(peer.peer_id), new, expiration_time=now + 120, subkey=peer.peer_id)
        # the old record, replayed with its own expiry, is older than the stored one: the DHT keeps the newer
        assert not dht.store(peers_key(peer.peer_id), old, expiration_time=now + 60, subkey=peer.peer_id)
        # and kept alive past its own signed expiry, or already expired, the validator refuses it
        assert not dht.store(peers_key(peer.peer_id), old, expiration_time=now + 600, subkey=peer.peer_id)
        assert not dht.store(peers_key(peer.peer_id), expired, expiration_time=now + 600, subkey=peer.peer_id)
        rejected = wait_until(lambda: dht_record_rejections(dht), 5.0, message="the replays to be counted")
        assert rejected.get("outlives its expiry", 0) >= 1 and rejected.get("expired", 0) >= 1, rejected
        assert [(r.peer_id, r.seq) for r in ResourceGraph(dht).records()] == [(peer.peer_id, 8)]
    finally:
        stop_dht(dht)


def _group(n: int = 3) -> list[Identity]:
    return sorted((Identity.generate() for _ in range(n)), key=lambda i: i.peer_id)


def _receipt(signer: Identity, group: list[Identity], *, round_: int, run: str = RUN, samples: int = 64):
    return sign_receipt(
        Receipt(
            run=run,
            round=round_,
            group_id=f"group-{round_}",
            members=tuple(i.peer_id for i in group),
            peer=signer.peer_id,
            samples=samples,
            bytes_sent=10,
            bytes_received=20,
            ledger_seq=0,
            ledger_head="0" * 64,
            t=1,
        ),
        signer,
    )


def test_old_or_foreign_receipts_in_a_manifest_are_refused():
    group = _group()
    manifest = Manifest(
        run_id=RUN,
        step=5,
        round=5,
        task="charlm",
        config_digest="ab" * 32,
        parent="",
        shards=(),
        participants=tuple(i.peer_id for i in group),
        created_at=1,
        contributions={i.peer_id: 64 for i in group},
    )
    good = [_receipt(i, group, round_=5) for i in group]
    sealed = _sealed(manifest, group)
    assert (
        verify_manifest(
            SignedManifest(manifest=manifest, signatures=sealed.signatures, receipts=tuple(good)), run_id=RUN
        )
        == manifest
    )
    cases = {
        "an old round's receipt": [*good[:2], _receipt(group[2], group, round_=4)],
        "another run's receipt": [*good[:2], _receipt(group[2], group, round_=5, run=OTHER_RUN)],
        "the same receipt twice": [good[0], good[0], good[1]],
        "a receipt that disagrees with the group": [*good[:2], _receipt(group[2], group, round_=5, samples=10**6)],
    }
    for name, receipts in cases.items():
        signed = SignedManifest(manifest=manifest, signatures=sealed.signatures, receipts=tuple(receipts))
        counter: Counter[str] = Counter()
        with pytest.raises(ManifestRejected) as info:  # from bytes, as a peer receives it
            verify_manifest(signed.to_bytes(), run_id=RUN, counter=counter)
        assert info.value.reason == "bad receipt" and counter == {"bad receipt": 1}, (name, info.value)


class _Board:
    """A stand-in for `swarm.checkpoint.posts.GroupPosts`: posts filed by key and sender (what _ReceiptSwap sends
    and what its `poll` reads, directly or from the DHT alike)."""

    def __init__(self) -> None:
        self.values: dict[str, dict[str, object]] = {}

    def post(self, key, value, *, sender, to) -> None:
        self.values.setdefault(key, {})[sender] = value

    def read(self, key, *, since):
        return list(self.values.get(key, {}).items())


def test_a_replayed_receipt_is_not_taken_in_the_receipt_swap():
    me, peer, outsider = _group()
    group = sorted([me, peer], key=lambda i: i.peer_id)
    manager = SimpleNamespace(run_id=RUN, posts=_Board(), receipt_rejections=Counter())
    swap = _ReceiptSwap(manager, _receipt(me, group, round_=5))
    key = swap.key
    # the peer's genuine receipt of an earlier round, of another run, and an outsider's posted under its name
    manager.posts.post(key, _receipt(peer, group, round_=4).to_dict(), sender=peer.peer_id, to=())
    swap.poll()
    manager.posts.post(key, _receipt(peer, group, round_=5, run=OTHER_RUN).to_dict(), sender=peer.peer_id, to=())
    swap.poll()
    trio = sorted([me, outsider, peer], key=lambda i: i.peer_id)
    manager.posts.post(key, _receipt(outsider, trio, round_=5).to_dict(), sender=peer.peer_id, to=())
    swap.poll()
    assert not swap.complete() and set(swap.found) == {me.peer_id}
    assert manager.receipt_rejections == {"another round or peer": 2, "another run": 1}
    manager.posts.post(key, _receipt(peer, group, round_=5).to_dict(), sender=peer.peer_id, to=())
    swap.poll()
    assert swap.complete()


def test_replayed_ledger_entries_are_blamed(tmp_path):
    owner = Identity.generate()
    path = tmp_path / RUN / f"{owner.peer_id}.sqlite"
    other = tmp_path / OTHER_RUN / f"{owner.peer_id}.sqlite"
    for file, run in ((path, RUN), (other, OTHER_RUN)):
        with Ledger(file, identity=owner, run=run) as ledger:
            for step in range(3):
                ledger.append("train", {"step": step}, t=1_800_000_000 + step)
    columns = "seq, t_ms, kind, peer, run, body, prev, digest, signature"
    with contextlib.closing(sqlite3.connect(other)) as conn:
        foreign = conn.execute(f"SELECT {columns} FROM entries WHERE seq = 2").fetchone()
    with contextlib.closing(sqlite3.connect(path)) as conn:  # the owner's own entry 2 of another run, replayed
        conn.execute("DELETE FROM entries WHERE seq = 2")
        conn.execute(f"INSERT INTO entries ({columns}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", foreign)
        conn.commit()
    verdict = verify_ledger(path)
    assert verdict.first_bad_seq == 2 and verdict.run == RUN
    problems = " | ".join(verdict.problems)
    assert f"names run '{OTHER_RUN}'" in problems and "signature does not verify" in problems, problems
    assert verify_ledger(other).ok

    with contextlib.closing(sqlite3.connect(other)) as conn:  # an old entry of the run re-appended as the newest
        first = conn.execute(f"SELECT {columns} FROM entries WHERE seq = 1").fetchone()
        conn.execute(f"INSERT INTO entries ({columns}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", (4, *first[1:]))
        conn.commit()
    verdict = verify_ledger(other)
    assert verdict.first_bad_seq == 4 and any("digest mismatch" in p for p in verdict.problems), verdict.problems
    assert any("prev does not name" in p for p in verdict.problems), verdict.problems


# ================================================================================================ stolen peer IDs
def test_a_participant_cannot_sign_a_manifest_for_another():
    group = _group(4)  # default quorum: 3 of 4
    a, b, attacker, victim = group[0], group[1], group[2], group[3]
    manifest = Manifest(
        run_id=RUN,
        step=3,
        round=3,
        task="charlm",
        config_digest="ab" * 32,
        parent="",
        shards=(),
        participants=tuple(i.peer_id for i in group),
        created_at=1,
    )
    two = _sealed(manifest, [a, attacker])
    forged = {
        "the attacker's own signature under the victim's ID": two.with_signature(
            victim.peer_id, sign_manifest(manifest, attacker)[1]
        ),
        "another member's signature copied under the victim's ID": two.with_signature(
            victim.peer_id, two.signatures[a.peer_id]
        ),
    }
    for name, signed in forged.items():
        counter: Counter[str] = Counter()
        with pytest.raises(ManifestRejected) as info:
            verify_manifest(signed.to_bytes(), run_id=RUN, counter=counter)
        assert info.value.reason == "bad signature" and victim.peer_id in str(info.value), name
        assert counter == {"bad signature": 1}
    assert verify_manifest(_sealed(manifest, [a, b, attacker]), run_id=RUN) == manifest  # three honest signatures do


def test_group_metadata_with_a_borrowed_binding_is_rejected():
    member, other = Identity.generate(), Identity.generate()

    def metadata(binding: PeerBinding) -> dict:
        return {"round": 1, "samples": 32, "binding": binding.to_dict()}

    assert _gathered_problem(member.peer_id, metadata(member.bind(member.peer_id))) is None
    wrong_domain = PeerBinding(
        peer_id=member.peer_id,
        public_key=member.public_key,
        signature=member.sign(kind=RECORD_KIND, run_id="", payload=member.bind(member.peer_id).payload()),
    )
    cases = {
        "another peer's valid binding": (other.bind(other.peer_id), "identity binding names another peer"),
        "a binding of this peer ID signed by another key": (
            other.bind(member.peer_id),
            "identity binding signature does not verify",
        ),
        "a binding signed for another kind": (wrong_domain, "identity binding signature does not verify"),
    }
    for name, (binding, reason) in cases.items():
        assert _gathered_problem(member.peer_id, metadata(binding)) == reason, name
    assert (
        _gathered_problem(member.peer_id, {"round": 1, "samples": 32, "binding": {"peer_id": 1}})
        == "malformed identity binding"
    )
