"""The evidence ledger (swarm.ledger): hash chain, signatures, tamper detection, receipts and the CLI.

Tampering is done with plain sqlite3 on the file, as an attacker holding it would; every check
asserts which entry is blamed, so a verifier that flags everything (or nothing) fails.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sqlite3
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from helpers import python_cmd, spawn, terminate, wait_until

from bootstrap.identity import Identity
from swarm.ledger import (
    GENESIS,
    LEDGER_KIND,
    RECEIPT_KIND,
    Ledger,
    LedgerError,
    Receipt,
    ReceiptRejected,
    SignedReceipt,
    contributions,
    default_ledger_path,
    find_ledgers,
    read_entries,
    sign_receipt,
    verify_ledger,
    verify_receipt,
)
from swarm.ledger.__main__ import main
from swarm.ledger.chain import entry_digest

RUN = "ledger-test"


# ---------------------------------------------------------------------------------------------- helpers


@pytest.fixture
def owner() -> Identity:
    return Identity.generate()


def _write(path: Path, identity: Identity, *, num_entries: int = 5, run: str = RUN) -> Path:
    with Ledger(path, identity=identity, run=run) as ledger:
        for step in range(num_entries):
            ledger.append("train", {"step": step, "loss": 2.5 - step / 10}, t=1_800_000_000 + step)
    return path


@pytest.fixture
def ledger_path(tmp_path: Path, owner: Identity) -> Path:
    return _write(default_ledger_path(tmp_path, run=RUN, peer_id=owner.peer_id), owner)


def _sql(path: Path, *statements: str, params: tuple = ()) -> None:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        for statement in statements:
            conn.execute(statement, params)
        conn.commit()


def _rows(path: Path) -> list[tuple]:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return conn.execute(
            "SELECT seq, t_ms, kind, peer, run, body, prev, digest, signature FROM entries ORDER BY seq"
        ).fetchall()


def _rechain(path: Path) -> None:
    """Recompute every digest and prev link, as an attacker without the owner's key can."""
    prev = GENESIS
    with contextlib.closing(sqlite3.connect(path)) as conn:
        for seq, t_ms, kind, peer, run, body, *_ in _rows(path):
            digest = entry_digest(seq=seq, t_ms=t_ms, kind=kind, peer=peer, run=run, body_text=body, prev=prev)
            conn.execute("UPDATE entries SET prev = ?, digest = ? WHERE seq = ?", (prev, digest, seq))
            prev = digest
        conn.commit()


def _receipt(
    identity: Identity,
    *,
    members: list[Identity],
    round_: int = 1,
    head: tuple[int, str] = (0, GENESIS),
    samples: int = 64,
    group_id: str | None = None,
    run: str = RUN,
) -> SignedReceipt:
    receipt = Receipt(
        run=run,
        round=round_,
        group_id=group_id or f"group-{round_}",
        members=tuple(sorted(m.peer_id for m in members)),
        peer=identity.peer_id,
        samples=samples,
        bytes_sent=1_000 * round_,
        bytes_received=2_000 * round_,
        ledger_seq=head[0],
        ledger_head=head[1],
        t=1_800_000_000 + round_,
    )
    return sign_receipt(receipt, identity)


# ---------------------------------------------------------------------------------------------- the chain


def test_clean_ledger_verifies_and_continues_after_reopen(ledger_path, owner):
    with Ledger(ledger_path, identity=owner, run=RUN) as ledger:
        assert ledger.head()[0] == 5
        entry = ledger.append("val", {"val_loss": float("nan"), "round": 3, "members": ("a", "b")}, t=1_800_000_009.5)
    assert (entry.seq, entry.t, entry.body) == (
        6,
        1_800_000_009.5,
        {"val_loss": None, "round": 3, "members": ["a", "b"]},
    )
    entries = read_entries(ledger_path)
    assert [e.seq for e in entries] == [1, 2, 3, 4, 5, 6]
    assert entries[0].prev == GENESIS and all(b.prev == a.digest for a, b in zip(entries, entries[1:]))
    assert entries[-1] == entry and entries[2].body == {"step": 2, "loss": 2.3}
    verdict = verify_ledger(ledger_path)
    assert verdict.ok and verdict.problems == [] and verdict.first_bad_seq is None
    assert (verdict.peer, verdict.run, verdict.num_entries, verdict.head) == (owner.peer_id, RUN, 6, (6, entry.digest))
    assert find_ledgers(ledger_path.parent.parent) == [ledger_path]
    with contextlib.closing(sqlite3.connect(ledger_path)) as conn:  # readers never block the writer
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_default_ledger_path_layout_and_unsafe_names(tmp_path):
    assert default_ledger_path(tmp_path, run="r1", peer_id="12D3KooWabc") == tmp_path / "r1" / "12D3KooWabc.sqlite"
    assert default_ledger_path("~/x", run="r", peer_id="p") == Path.home() / "x" / "r" / "p.sqlite"
    for run in ("..", "a/b", "", "a\x00b", "a\nb"):
        with pytest.raises(ValueError, match="run"):
            default_ledger_path(tmp_path, run=run, peer_id="p")


@pytest.mark.parametrize(
    "edit",
    [
        'UPDATE entries SET body = \'{"loss":0.01,"step":2}\' WHERE seq = 3',
        "UPDATE entries SET kind = 'val' WHERE seq = 3",
        "UPDATE entries SET t_ms = t_ms + 1 WHERE seq = 3",
    ],
    ids=["body", "kind", "time"],
)
def test_an_edited_entry_is_blamed_for_a_digest_mismatch(ledger_path, edit):
    _sql(ledger_path, edit)
    verdict = verify_ledger(ledger_path)
    assert not verdict.ok and verdict.first_bad_seq == 3
    assert verdict.problems == ["seq 3: digest mismatch: the entry was edited after it was written"]


def test_a_row_with_wrong_types_is_reported_not_raised(ledger_path):
    _sql(ledger_path, "UPDATE entries SET t_ms = 'soon', body = 'not json' WHERE seq = 2")
    verdict = verify_ledger(ledger_path)
    assert verdict.first_bad_seq == 2 and verdict.problems == ["seq 2: malformed row (t_ms, body)"]
    with pytest.raises(LedgerError, match="seq 2 .* malformed"):
        read_entries(ledger_path)


def test_a_deleted_middle_entry_breaks_the_chain(ledger_path):
    _sql(ledger_path, "DELETE FROM entries WHERE seq = 3")
    verdict = verify_ledger(ledger_path)
    assert not verdict.ok and verdict.first_bad_seq == 4 and verdict.num_entries == 4
    assert "entries were deleted" in verdict.problems[0] and "prev does not name" in verdict.problems[1]


def test_reordered_entries_are_detected(ledger_path):
    _sql(
        ledger_path,
        "UPDATE entries SET seq = 100 WHERE seq = 2",
        "UPDATE entries SET seq = 2 WHERE seq = 3",
        "UPDATE entries SET seq = 3 WHERE seq = 100",
    )
    verdict = verify_ledger(ledger_path)
    assert not verdict.ok and verdict.first_bad_seq == 2
    assert any(p.startswith("seq 2: digest mismatch") for p in verdict.problems)
    assert any(p.startswith("seq 3: prev does not name") for p in verdict.problems)


def test_digests_recomputed_without_the_key_fail_the_signature_check(ledger_path):
    _sql(ledger_path, 'UPDATE entries SET body = \'{"loss":0.01,"step":1}\' WHERE seq = 2')
    _rechain(ledger_path)  # every digest and link is consistent again; only the signatures can tell
    verdict = verify_ledger(ledger_path)
    assert verdict.first_bad_seq == 2 and not any("digest mismatch" in p or "prev" in p for p in verdict.problems)
    assert [p.split(":")[0] for p in verdict.problems] == ["seq 2", "seq 3", "seq 4", "seq 5"]
    assert all("signature does not verify" in p for p in verdict.problems)


def test_a_chain_resigned_by_another_key_is_refused(tmp_path, ledger_path, owner):
    thief = Identity.generate()
    copy = _write(tmp_path / "thief.sqlite", thief)
    rows = _rows(copy)
    _sql(ledger_path, "DELETE FROM entries")
    with contextlib.closing(sqlite3.connect(ledger_path)) as conn:
        conn.executemany("INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
        conn.commit()
    verdict = verify_ledger(ledger_path)  # the thief's valid chain, under the owner's name
    assert verdict.first_bad_seq == 1 and verdict.peer == owner.peer_id
    assert f"names peer '{thief.peer_id}', not the ledger's owner" in verdict.problems[0]
    assert "signature does not verify" in verdict.problems[1]
    _sql(ledger_path, "UPDATE meta SET value = ? WHERE key = 'peer'", params=(thief.peer_id,))
    verdict = verify_ledger(ledger_path)  # now the chain checks out, but the file is the owner's
    assert verdict.problems == [f"the file is named after peer {owner.peer_id} but belongs to {thief.peer_id}"]
    assert verify_ledger(copy).ok


def test_opening_another_peers_or_runs_ledger_is_refused(ledger_path, owner):
    with pytest.raises(LedgerError, match="belongs to peer"):
        Ledger(ledger_path, identity=Identity.generate(), run=RUN)
    with pytest.raises(LedgerError, match="belongs to run"):
        Ledger(ledger_path, identity=owner, run="another-run")
    assert verify_ledger(ledger_path).num_entries == 5  # untouched


def test_opening_a_ledger_with_a_corrupt_newest_entry_is_refused(ledger_path, owner):
    _sql(ledger_path, "UPDATE entries SET body = '{}' WHERE seq = 5")
    with pytest.raises(LedgerError, match="corrupt at its newest entry"):
        Ledger(ledger_path, identity=owner, run=RUN)


def test_garbage_and_foreign_files_are_not_ledgers(tmp_path, owner):
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(b"\x13\x37" * 5000)
    foreign = tmp_path / "foreign.sqlite"
    _sql(foreign, "CREATE TABLE entries (x INTEGER)")
    missing = tmp_path / "missing.sqlite"
    for path, reason in (
        (garbage, "not a readable SQLite file"),
        (foreign, "not a swarm ledger"),
        (missing, "no ledger file"),
    ):
        verdict = verify_ledger(path)
        assert not verdict.ok and reason in verdict.problems[0] and verdict.head == (0, GENESIS)
        with pytest.raises(LedgerError, match=reason):
            read_entries(path)
    for path in (garbage, foreign):
        with pytest.raises(LedgerError):
            Ledger(path, identity=owner, run=RUN)
    assert garbage.read_bytes() == b"\x13\x37" * 5000 and not missing.exists()
    assert find_ledgers(tmp_path) == []


def test_bad_appends_are_refused_and_a_closed_ledger_stays_closed(tmp_path, owner):
    ledger = Ledger(tmp_path / "l.sqlite", identity=owner, run=RUN)
    for kind, body, t in (
        ("no spaces", {}, None),
        ("ok", [1], None),
        ("ok", {1: 2}, None),
        ("ok", {"x": object()}, None),
        ("ok", {}, float("inf")),
        ("ok", {}, -1),
    ):
        with pytest.raises((ValueError, TypeError)):
            ledger.append(kind, body, t=t)
    assert ledger.head() == (0, GENESIS)
    ledger.close()
    ledger.close()
    with pytest.raises(LedgerError, match="closed"):
        ledger.append("ok", {})


def test_concurrent_writers_keep_one_chain(tmp_path, owner):
    path = tmp_path / "l.sqlite"
    first, second = Ledger(path, identity=owner, run=RUN), Ledger(path, identity=owner, run=RUN)

    def write(ledger: Ledger, worker: int) -> None:
        for i in range(50):
            ledger.append("train", {"worker": worker, "i": i})

    threads = [threading.Thread(target=write, args=(ledger, w)) for w, ledger in enumerate([first, second] * 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    first.close()
    second.close()
    verdict = verify_ledger(path)
    assert verdict.ok and verdict.num_entries == 200, verdict.problems


def test_appends_are_fast_enough(tmp_path, owner):
    with Ledger(tmp_path / "l.sqlite", identity=owner, run=RUN) as ledger:
        start = time.perf_counter()
        for step in range(1000):
            ledger.append("train", {"step": step, "loss": 1.0, "samples_per_s": 123.4})
        elapsed_s = time.perf_counter() - start
    assert elapsed_s < 2.0, f"1000 appends took {elapsed_s:.2f} s (want > 500/s)"


_CHILD = """
import sys
from bootstrap.identity import Identity
from swarm.ledger import Ledger
ledger = Ledger(sys.argv[1], identity=Identity.load_or_create(sys.argv[2]), run=sys.argv[3])
while True:
    ledger.append("train", {"step": ledger.head()[0], "pad": "x" * 300})
"""


def _count(path: Path) -> int:
    try:
        with contextlib.closing(sqlite3.connect(path.as_uri() + "?mode=ro", uri=True)) as conn:
            return conn.execute("SELECT COUNT(*) FROM entries").fetchone()[0]
    except sqlite3.Error:
        return 0


def test_sigkill_mid_append_leaves_a_valid_chain_that_continues(tmp_path):
    key, path = tmp_path / "id.key", tmp_path / "l.sqlite"
    identity = Identity.load_or_create(key)
    child = spawn(python_cmd("-c", _CHILD, str(path), str(key), RUN))
    try:
        wait_until(lambda: _count(path) >= 300, timeout_s=30, message=lambda: f"300 entries\n{child.describe()}")
    finally:
        assert terminate(child, sig=signal.SIGKILL) == -signal.SIGKILL
    verdict = verify_ledger(path)
    assert verdict.ok and verdict.num_entries >= 300, verdict.problems
    with Ledger(path, identity=identity, run=RUN) as ledger:
        assert ledger.append("start", {}).seq == verdict.num_entries + 1
    assert verify_ledger(path).ok


# ---------------------------------------------------------------------------------------------- receipts


def test_receipt_sign_verify_round_trip(owner):
    other = Identity.generate()
    signed = _receipt(owner, members=[owner, other], head=(7, "ab" * 32))
    data = signed.to_dict()
    assert set(data) == {"receipt", "signature"} and isinstance(data["receipt"]["members"], list)
    assert verify_receipt(data, run_id=RUN) == signed
    assert verify_receipt(json.dumps(data).encode()) == signed
    assert signed.receipt.digest() == _receipt(owner, members=[other, owner], head=(7, "ab" * 32)).receipt.digest()
    with pytest.raises(ValueError, match="signing identity"):
        sign_receipt(signed.receipt, other)


def _forge(signed: SignedReceipt, **changes) -> dict:
    data = signed.to_dict()
    data["receipt"].update(changes)
    return data


def _cases(owner: Identity, other: Identity) -> dict[str, tuple[object, str, str | None]]:
    good = _receipt(owner, members=[owner, other])
    fields = good.receipt.to_dict()
    foreign_sig = other.sign(kind=RECEIPT_KIND, run_id=RUN, payload=good.receipt.payload()).hex()
    wrong_domain = owner.sign(kind=LEDGER_KIND, run_id=RUN, payload=good.receipt.payload()).hex()
    return {  # name: (data, expected reason, run_id)
        "tampered samples": (_forge(good, samples=10**6), "bad signature", None),
        "flipped signature": (
            {**good.to_dict(), "signature": ("0" if good.signature[0] != "0" else "1") + good.signature[1:]},
            "bad signature",
            None,
        ),
        "signed by another key for the peer": ({**good.to_dict(), "signature": foreign_sig}, "bad signature", None),
        "signed for another kind": ({**good.to_dict(), "signature": wrong_domain}, "bad signature", None),
        "wrong run": (good.to_dict(), "another run", "another-run"),
        "peer not in members": (_forge(good, members=[other.peer_id]), "peer not a member", None),
        "unsorted members": (
            _forge(good, members=sorted(fields["members"], reverse=True)),
            "members not sorted and unique",
            None,
        ),
        "duplicate members": (
            _forge(good, members=[owner.peer_id, owner.peer_id]),
            "members not sorted and unique",
            None,
        ),
        "bool as int": (_forge(good, samples=True), "malformed", None),
        "str as int": (_forge(good, round="1"), "malformed", None),
        "float time": (_forge(good, t=1.5), "malformed", None),
        "negative int": (_forge(good, bytes_sent=-1), "malformed", None),
        "members not a list": (_forge(good, members=owner.peer_id), "malformed", None),
        "extra key": (_forge(good, bonus=1), "malformed", None),
        "missing key": (
            {"receipt": {k: v for k, v in fields.items() if k != "t"}, "signature": good.signature},
            "malformed",
            None,
        ),
        "extra top-level key": ({**good.to_dict(), "x": 1}, "malformed", None),
        "uppercase head": (_forge(good, ledger_seq=3, ledger_head="AB" * 32), "malformed", None),
        "head without seq": (_forge(good, ledger_head="ab" * 32), "malformed", None),
        "short signature": ({**good.to_dict(), "signature": "ab" * 32}, "malformed", None),
        "not an object": ([good.to_dict()], "malformed", None),
        "float in JSON bytes": (json.dumps(_forge(good, t=1.5)).encode(), "malformed", None),
        "newer version": (_forge(good, v=2), "unsupported version", None),
        "bool version": (_forge(good, v=True), "unsupported version", None),
        "oversized": (_forge(good, group_id="g" * 9000), "oversized", None),
        "too many members": (_forge(good, members=sorted(f"p{i:04}" for i in range(200))), "malformed", None),
    }


@pytest.mark.parametrize("case", list(_cases(Identity.generate(), Identity.generate())))
def test_receipt_rejections_are_counted_by_reason(case):
    data, reason, run_id = _cases(Identity.generate(), Identity.generate())[case]
    counter: Counter[str] = Counter()
    with pytest.raises(ReceiptRejected) as caught:
        verify_receipt(data, run_id=run_id, counter=counter)
    assert caught.value.reason == reason
    assert counter == Counter({reason: 1})


def test_rejections_count_only_in_the_callers_counter(owner):
    import swarm.ledger.receipts as receipts_module

    with pytest.raises(ReceiptRejected):  # no counter given: refused all the same, counted nowhere
        verify_receipt(_forge(_receipt(owner, members=[owner]), samples=1))
    assert not [v for v in vars(receipts_module).values() if isinstance(v, Counter)]  # no process-wide counter
    mine: Counter[str] = Counter()
    with pytest.raises(ReceiptRejected):
        verify_receipt(_forge(_receipt(owner, members=[owner]), samples=1), counter=mine)
    assert mine == Counter({"bad signature": 1})


def test_a_receipt_with_the_most_members_fits_the_size_limit(owner):
    members = [Identity.generate() for _ in range(127)] + [owner]
    assert (
        verify_receipt(_receipt(owner, members=members, head=(2**62, "f" * 64)).to_dict()).receipt.peer == owner.peer_id
    )


def test_contributions_count_each_receipt_once(owner):
    other = Identity.generate()
    group = [owner, other]
    round1 = [_receipt(owner, members=group, round_=1), _receipt(other, members=group, round_=1)]
    round2 = [_receipt(owner, members=group, round_=2), _receipt(owner, members=group, round_=2, group_id="retry")]
    totals = contributions(round1 * 3 + round2)  # copies from three ledgers
    assert totals[owner.peer_id].rounds == 2 and totals[owner.peer_id].num_receipts == 3
    assert (totals[owner.peer_id].samples, totals[owner.peer_id].bytes_sent) == (3 * 64, 1_000 + 2 * 2_000)
    assert (totals[owner.peer_id].first_round, totals[owner.peer_id].last_round) == (1, 2)
    assert (totals[other.peer_id].rounds, totals[other.peer_id].samples) == (1, 64)
    # two versions of one receipt: one is kept, whatever the order
    versions = [_receipt(owner, members=group, samples=10), _receipt(owner, members=group, samples=99)]
    assert contributions(versions) == contributions(versions[::-1])
    assert contributions(versions)[owner.peer_id].samples in (10, 99)


# ---------------------------------------------------------------------------------------------- the CLI


def _json_out(capsys) -> dict:
    return json.loads(capsys.readouterr().out)


def test_cli_verify_exit_codes(tmp_path, ledger_path, capsys):
    assert main(["verify", str(tmp_path)]) == 0
    assert "1 ledger(s), 0 failed verification" in " ".join(capsys.readouterr().out.split())
    _sql(ledger_path, "UPDATE entries SET body = '{}' WHERE seq = 2")
    assert main(["verify", str(ledger_path), "--json"]) == 1
    out = _json_out(capsys)
    assert out["ok"] is False and out["ledgers"][0]["first_bad_seq"] == 2
    assert main(["verify", str(tmp_path / "nowhere")]) == 2
    (tmp_path / "empty").mkdir()
    assert main(["verify", str(tmp_path / "empty")]) == 2
    assert "no ledger" in capsys.readouterr().err


def _two_peers_with_a_round(tmp_path: Path) -> tuple[Identity, Path, Path]:
    """Ledgers of peers A and B; A's receipt of round 1 names A's entry 5, and both ledgers hold it."""
    a, b = Identity.generate(), Identity.generate()
    paths = [default_ledger_path(tmp_path, run=RUN, peer_id=p.peer_id) for p in (a, b)]
    with Ledger(paths[0], identity=a, run=RUN) as la, Ledger(paths[1], identity=b, run=RUN) as lb:
        for step in range(5):
            la.append("train", {"step": step})
        lb.append("train", {"step": 0})
        receipts = [_receipt(a, members=[a, b], head=la.head()), _receipt(b, members=[a, b], head=lb.head())]
        assert receipts[0].receipt.ledger_seq == 5
        for ledger in (la, lb):
            for signed in receipts:
                ledger.append("receipt", signed.to_dict())
        la.append("stop", {"step": 5})
    return a, paths[0], paths[1]


def test_cli_verify_cross_check_catches_a_truncated_or_rewritten_ledger(tmp_path, capsys):
    a, path_a, path_b = _two_peers_with_a_round(tmp_path)
    assert main(["verify", str(tmp_path), "--json"]) == 0
    assert _json_out(capsys)["cross_check"] == []
    _sql(path_a, "DELETE FROM entries WHERE seq >= 4")  # A cuts its history back to before the round
    assert main(["verify", str(path_a)]) == 0  # a hash chain alone cannot see a cut tail
    capsys.readouterr()
    assert main(["verify", str(path_a), str(path_b), "--json"]) == 1
    out = _json_out(capsys)
    assert all(v["ok"] for v in out["ledgers"]) and len(out["cross_check"]) == 1
    assert "tail was cut" in out["cross_check"][0] and a.peer_id in out["cross_check"][0]
    with Ledger(path_a, identity=a, run=RUN) as ledger:  # A writes a new, validly signed history instead
        for step in range(3):
            ledger.append("train", {"step": 100 + step})
    assert main(["verify", str(tmp_path), "--json"]) == 1
    out = _json_out(capsys)
    assert all(v["ok"] for v in out["ledgers"]) and len(out["cross_check"]) == 1
    assert "rewritten" in out["cross_check"][0]


def test_cli_receipts_json(tmp_path, capsys):
    a, b, c = (Identity.generate() for _ in range(3))
    ledgers = {
        p.peer_id: Ledger(default_ledger_path(tmp_path, run=RUN, peer_id=p.peer_id), identity=p, run=RUN)
        for p in (a, b, c)
    }
    round1 = [_receipt(p, members=[a, b], round_=1, samples=10) for p in (a, b)]
    round2 = [_receipt(p, members=[a, b, c], round_=2, samples=20) for p in (a, b, c)]
    for signed in round1 + round2[:2]:
        for peer in signed.receipt.members:
            ledgers[peer].append("receipt", signed.to_dict())
    ledgers[c.peer_id].append("receipt", round2[2].to_dict())  # c's own receipt reached no one else
    ledgers[c.peer_id].append("receipt", _forge(round2[0], samples=10**9))  # and c lies about a's
    for ledger in ledgers.values():
        ledger.close()
    _write(default_ledger_path(tmp_path, run="other", peer_id=a.peer_id), a, run="other")
    assert main(["receipts", "--run", RUN, "--dir", str(tmp_path), "--json"]) == 0
    out = _json_out(capsys)
    assert out["num_ledgers"] == 3 and out["rejected"] == {"bad signature": 1} and out["unverified_ledgers"] == []
    rows = {row["peer"]: row for row in out["peers"]}
    assert {k: rows[a.peer_id][k] for k in ("rounds", "receipts", "witnessed", "samples", "bytes_sent")} == {
        "rounds": 2,
        "receipts": 2,
        "witnessed": 2,
        "samples": 30,
        "bytes_sent": 3_000,
    }
    assert (rows[c.peer_id]["rounds"], rows[c.peer_id]["witnessed"]) == (1, 0)
    assert main(["receipts", "--run", RUN, "--dir", str(tmp_path)]) == 0
    assert "bad signature: 1" in capsys.readouterr().out
    assert main(["receipts", "--run", "no-such-run", "--dir", str(tmp_path)]) == 2
    assert main(["receipts", "--run", RUN, "--dir", str(tmp_path / "nowhere")]) == 2


def test_cli_show(ledger_path, owner, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # one table row per line
    with Ledger(ledger_path, identity=owner, run=RUN) as ledger:
        ledger.append("val", {"val_loss": 1.5, "note": "[bold]not markup[/bold]"})
        ledger.append("train", {"step": 5})
    assert main(["show", str(ledger_path), "--kind", "train", "--last", "2", "--json"]) == 0
    assert [(e["seq"], e["body"]["step"]) for e in _json_out(capsys)] == [(5, 4), (7, 5)]
    assert main(["show", str(ledger_path), "--kind", "val"]) == 0
    assert '"note":"[bold]not markup[/bold]"' in capsys.readouterr().out
    assert main(["show", str(ledger_path.parent / "missing.sqlite")]) == 2
