"""Owner-bound DHT records (bootstrap.owned): only a subkey's owner can write it, in every Swarm node.

* the validator alone: a record verifies only as its owner signed it (key, subkey, value, expiry);
  every other form is refused with its counted reason; capability records pass to their own validator;
* real DHTs: an outsider (plain hivemind, forging signatures with its own key) cannot replace or hide a
  Swarm peer's record, under a test key and under every key a run writes (status, receipts, seal
  signatures, manifest index, matchmaking); the same attacks on nodes without the validator do (the
  negative control).
"""

from __future__ import annotations

import dataclasses
import pickle

import hivemind
import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

from averaging.group import matchmaking_key
from bootstrap import start_dht, stop_dht, visible_maddrs
from bootstrap.identity import Identity
from bootstrap.network import start_swarm_dht
from bootstrap.owned import OwnerBoundValidator, dht_owned_rejections
from bootstrap.records import peers_key
from swarm.checkpoint.gossip import index_key
from swarm.checkpoint.sync import receipts_key, seal_key
from swarm.status import status_key
from tests.helpers import wait_until

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
KEY = "swarm/test/status"
RUN = "owned-test"
RUN_KEYS = {
    "status": status_key(RUN),
    "receipts": receipts_key(RUN, "g" * 16),
    "seal": seal_key(RUN, "d" * 64),
    "manifest index": index_key(RUN),
    "matchmaking": matchmaking_key(RUN, 1, 0),
}
"""Every kind of record a run writes, under the names the code gives them."""


def _record(owner: Identity, value: object = None, *, key: str = KEY, expiration: float = 1e9) -> DHTRecord:
    return DHTRecord(
        key=DHTID.generate(source=key).to_bytes(),
        subkey=MSGPackSerializer.dumps(owner.peer_id),
        value=MSGPackSerializer.dumps({"round": 3} if value is None else value),
        expiration_time=expiration,
    )


def _signed(validator: OwnerBoundValidator, record: DHTRecord) -> DHTRecord:
    return dataclasses.replace(record, value=validator.sign_value(record))


def test_a_record_verifies_only_as_its_owner_signed_it():
    owner, other = Identity.generate(), Identity.generate()
    signer, reader = OwnerBoundValidator(owner), OwnerBoundValidator()
    record = _signed(signer, _record(owner))
    assert reader.validate(record) and reader.strip_value(record) == _record(owner).value

    other_key = DHTID.generate(source="swarm/test/other").to_bytes()
    forged_by_other = _signed(OwnerBoundValidator(other), _record(other))
    tampered = {
        "bad signature": [
            dataclasses.replace(record, key=other_key),  # moved to another key
            dataclasses.replace(record, subkey=MSGPackSerializer.dumps(other.peer_id)),  # another's name
            dataclasses.replace(record, value=MSGPackSerializer.dumps({"round": 4}) + record.value[-64:]),
            dataclasses.replace(record, expiration_time=record.expiration_time + 600),  # kept alive longer
            dataclasses.replace(forged_by_other, subkey=record.subkey),  # signed by a stranger
        ],
        "no owner": [dataclasses.replace(record, subkey=MSGPackSerializer.dumps(None))],  # a plain value
        "subkey is not a peer id": [
            dataclasses.replace(record, subkey=MSGPackSerializer.dumps("junk")),
            dataclasses.replace(record, subkey=b"\xc1"),
        ],
        "unsigned": [_record(owner)],
        "non-finite expiration": [  # signed by the owner itself: immortal in every node's storage
            _signed(signer, _record(owner, expiration=float("nan"))),
            _signed(signer, _record(owner, expiration=float("inf"))),
        ],
    }
    for reason, records in tampered.items():
        for bad in records:
            assert not reader.validate(bad), reason
    assert reader.rejections.counts == {reason: len(records) for reason, records in tampered.items()}

    # not ours to sign: left unsigned, so every node refuses it
    assert signer.sign_value(_record(other)) == _record(other).value
    # capability records carry their own signature (PeerRecordValidator): passed through untouched
    capability = _record(other, key=peers_key(other.peer_id))
    assert reader.validate(capability) and reader.sign_value(capability) == capability.value


def test_validators_merge_their_identities_and_survive_the_trip_to_the_dht_process():
    a, b = Identity.generate(), Identity.generate()
    merged = OwnerBoundValidator(a)
    assert merged.merge_with(OwnerBoundValidator(b))
    copy = pickle.loads(pickle.dumps(merged))  # what DHT.add_validators sends to the DHT's process
    for owner in (a, b):
        assert OwnerBoundValidator().validate(_signed(copy, _record(owner)))


class _Forger(OwnerBoundValidator):
    """An outsider's validator: signs any subkey with its own key (what a stranger can do at best)."""

    def __init__(self, attacker: Identity) -> None:
        super().__init__(attacker)
        self.attacker = attacker

    def _signer(self, subkey: bytes) -> Identity | None:
        return self.attacker

    def validate(self, record: DHTRecord) -> bool:
        return True


def _attack(
    victim_dht: hivemind.DHT, reader: hivemind.DHT, outsider: hivemind.DHT, victim: Identity, key: str = KEY
) -> dict:
    """The victim stores its record; the outsider overwrites it (forged, later expiry) and tries to hide
    the whole key behind a plain value; what the reader then finds under the key."""
    now = get_dht_time()
    assert victim_dht.store(key, {"round": 3}, expiration_time=now + 60, subkey=victim.peer_id)
    outsider.store(key, {"round": 999}, expiration_time=now + 90, subkey=victim.peer_id)
    outsider.store(key, "nothing to see", expiration_time=now + 120)
    found = reader.get(key, latest=True, return_future=True).result(timeout=30)
    if found is None or not isinstance(found.value, dict):
        return {"hidden": found.value if found is not None else None}
    return {subkey: item.value for subkey, item in found.value.items()}


@pytest.mark.timeout(120)
@pytest.mark.heavy(seconds=20)
@pytest.mark.parametrize("owner_bound", [True, False], ids=["swarm nodes", "plain nodes (negative control)"])
def test_an_outsider_can_neither_replace_nor_hide_a_peers_record(owner_bound):
    victim, reader_id, attacker = Identity.generate(), Identity.generate(), Identity.generate()
    dhts = []
    try:
        if owner_bound:
            dhts.append(start_swarm_dht(victim, host_maddrs=LOOPBACK))
            dhts.append(start_swarm_dht(reader_id, initial_peers=visible_maddrs(dhts[0]), host_maddrs=LOOPBACK))
        else:
            dhts.append(hivemind.DHT(start=True, host_maddrs=LOOPBACK))
            dhts.append(hivemind.DHT(initial_peers=visible_maddrs(dhts[0]), start=True, host_maddrs=LOOPBACK))
        # on Swarm nodes the outsider signs its forgeries with its own key (the best a stranger can do)
        forger = [_Forger(attacker)] if owner_bound else []
        outsider = hivemind.DHT(
            initial_peers=visible_maddrs(dhts[0]), start=True, host_maddrs=LOOPBACK, record_validators=forger
        )
        dhts.append(outsider)
        found = _attack(dhts[0], dhts[1], outsider, victim)
        # and the same under every key a run writes: no status, receipt, seal signature, manifest-index entry
        # or matchmaking entry can be replaced or hidden either (the validator knows no key names)
        by_key = {kind: _attack(dhts[0], dhts[1], outsider, victim, key) for kind, key in RUN_KEYS.items()}
        if owner_bound:
            assert found == {victim.peer_id: {"round": 3}}, found
            assert by_key == {kind: {victim.peer_id: {"round": 3}} for kind in RUN_KEYS}, by_key
            # the fault fired: both Swarm nodes were asked to store the forgery and the plain value
            for dht in dhts[:2]:
                refused = wait_until(
                    lambda d=dht: (r := dht_owned_rejections(d)).get("bad signature") and r.get("no owner") and r,
                    10.0,
                    message="the outsider's writes to be refused",
                )
                assert refused["bad signature"] >= 1 and refused["no owner"] >= 1, refused
        else:
            assert found == {"hidden": "nothing to see"}, found  # the attack works where nothing checks owners
            assert by_key == {kind: {"hidden": "nothing to see"} for kind in RUN_KEYS}, by_key
    finally:
        for dht in reversed(dhts):
            stop_dht(dht)


@pytest.mark.timeout(120)
@pytest.mark.heavy(seconds=12)
def test_a_trainer_on_a_dht_passed_in_signs_its_records(tmp_path):
    """A DHT with the trainer's own key but none of our validators (a user's own hivemind.DHT): the
    trainer adds the signer, so its records are kept by Swarm nodes; before that, they are refused."""
    import torch

    from swarm.trainer import Trainer

    owner = Identity.generate()
    reader = start_swarm_dht(Identity.generate(), host_maddrs=LOOPBACK)
    trainer = None
    with owner.libp2p_identity_file() as path:
        dht = start_dht(
            visible_maddrs(reader),
            host_maddrs=LOOPBACK,
            identity_path=path,
            nat_port_map=False,
            check_if_identity_free=False,
        )
    try:
        expiration = get_dht_time() + 60
        dht.store(KEY, {"before": 1}, expiration_time=expiration, subkey=owner.peer_id)  # the control: refused
        before = reader.get(KEY, latest=True, return_future=True).result(timeout=30)
        assert before is None or owner.peer_id not in before.value, before
        assert dht_owned_rejections(reader).get("unsigned"), "the reader refused the unsigned record"
        model = torch.nn.Linear(4, 2)
        trainer = Trainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            run="own-dht",
            dht=dht,
            identity=owner,
            checkpoint_dir=str(tmp_path / "ck"),
            ledger_dir=str(tmp_path / "ledgers"),
            load_state=False,
        )
        assert dht.store(KEY, {"after": 1}, expiration_time=expiration + 1, subkey=owner.peer_id)
        found = reader.get(KEY, latest=True, return_future=True).result(timeout=30)
        assert found is not None and {k: v.value for k, v in found.value.items()} == {owner.peer_id: {"after": 1}}
    finally:
        if trainer is not None:
            trainer.shutdown()
        stop_dht(dht)
        stop_dht(reader)
