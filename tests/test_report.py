"""`swarm.report`: an HTML + PNG report from three synthetic ledgers written with the real Ledger API.

The run: alice and bob train rounds 1-3 together, bob vanishes without a "stop" (alice records the
failure and trains round 4 solo), carol joins with a state sync and replaces bob for rounds 5-6.
Every group member records every receipt of its group; alice also records one forged receipt, two
malformed entries, and strings meant to break out of the HTML.
"""

from __future__ import annotations

import re
import shutil
import sqlite3
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from bootstrap.identity import Identity
from swarm.ledger.chain import Ledger, default_ledger_path, find_ledgers, read_entries, verify_ledger
from swarm.ledger.receipts import Receipt, sign_receipt
from swarm.report import PNG_NAMES, VANISHED, build_parser, main, write_report

REPO_ROOT = Path(__file__).resolve().parent.parent
RUN = "report-run"
T0 = 1_800_000_000.0
EVIL_KIND = "<script>alert('kind')</script>"
EVIL_PEER = "<img src=x onerror=alert('peer')>$\\frac{1}{0}$"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MIN_PNG_BYTES = 5_000
NAMES = ("alice", "bob", "carol")


@dataclass(frozen=True, kw_only=True, slots=True)
class SimRun:
    """What the synthetic run wrote, and what the report must find in it."""

    root: Path
    """Folder holding the three ledgers."""
    ids: dict[str, Identity]
    """Name -> identity."""
    receipt_samples: dict[str, int]
    """Peer id -> samples backed by genuine receipts (one per peer and round)."""
    num_rejected_receipts: int
    """Receipt entries whose signature must fail."""
    num_malformed: int
    """Entries with mistyped fields, to be skipped and counted."""


def _members(round_number: int) -> tuple[str, ...]:
    return ("alice", "bob") if round_number <= 3 else ("alice",) if round_number == 4 else ("alice", "carol")


def _receipt(ledger: Ledger, identity: Identity, *, round_number: int, members: list[str], samples: int) -> dict:
    seq, head = ledger.head()
    receipt = Receipt(
        v=1,
        run=RUN,
        round=round_number,
        group_id=f"g{round_number}",
        members=tuple(members),
        peer=identity.peer_id,
        samples=samples,
        bytes_sent=1000 * round_number,
        bytes_received=900 * round_number,
        ledger_seq=seq,
        ledger_head=head,
        t=int(T0) + 10 * round_number,
    )
    return sign_receipt(receipt, identity).to_dict()


def _play_round(ledgers: dict[str, Ledger], ids: dict[str, Identity], r: int, expected: Counter) -> None:
    names = _members(r)
    peer_ids = sorted(ids[n].peer_id for n in names)
    base = T0 + 10 * r
    samples = {n: 100 * r + 10 * NAMES.index(n) for n in names}
    for n in names:
        ledgers[n].append(
            "train",
            {
                "step": 10 * r,
                "round": r,
                "loss": 3.0 - 0.1 * r,
                "samples_per_s": 50.0 + r + NAMES.index(n),
                "samples": samples[n],
            },
            t=base + 1,
        )
    receipts = [_receipt(ledgers[n], ids[n], round_number=r, members=peer_ids, samples=samples[n]) for n in names]
    for n in names:
        expected[ids[n].peer_id] += samples[n]
        val_loss = float("nan") if (n, r) == ("alice", 2) else 3.0 - 0.2 * r
        ledgers[n].append(
            "round",
            {
                "round": r,
                "step": 10 * r,
                "group_size": len(names),
                "group_id": f"g{r}",
                "members": peer_ids,
                "included": peer_ids,
                "outcome": "ok",
                "duration_s": 1.5,
                "bytes_sent": 1000 * r,
                "bytes_received": 900 * r,
                "samples": samples[n],
                "samples_per_s": 48.0 + r,
                "val_loss": val_loss,
                "failures": [],
                "rejected": {},
                "solo": len(names) == 1,
            },
            t=base + 3,
        )
        for receipt in receipts:
            ledgers[n].append("receipt", receipt, t=base + 3.5)
        ledgers[n].append("val", {"round": r, "step": 10 * r, "val_loss": 2.9 - 0.2 * r}, t=base + 4)
    if r in (3, 6):
        for n in names:
            ledgers[n].append(
                "checkpoint_sealed",
                {
                    "step": 10 * r,
                    "digest": f"{r:02d}" * 32,
                    "signers": peer_ids,
                    "participants": peer_ids,
                    "metrics": {"val_loss": 2.5, "samples": 300},
                },
                t=base + 5,
            )


def _lifecycle(ledgers: dict[str, Ledger], ids: dict[str, Identity]) -> None:
    for i, n in enumerate(("alice", "bob")):
        ledgers[n].append(
            "start", {"pid": 100 + i, "task": "charlm", "params": 12345, "device": "cpu", "shard": i}, t=T0 + i
        )
        ledgers[n].append(
            "joined",
            {"round": 0, "step": 0, "state_loaded": False, "state_verified": False, "join_s": 1.5, "manifest": None},
            t=T0 + 2 + i,
        )


def _failure_and_replacement(ledgers: dict[str, Ledger], ids: dict[str, Identity]) -> None:
    alice, bob, carol = (ids[n].peer_id for n in NAMES)
    ledgers["alice"].append(
        "failure", {"round": 4, "peer": bob, "phase": "matchmaking", "reason": "timeout"}, t=T0 + 40.5
    )
    ledgers["carol"].append(
        "start", {"pid": 102, "task": "charlm", "params": 12345, "device": "cpu", "shard": 2}, t=T0 + 41
    )
    ledgers["carol"].append(
        "joined",
        {"round": 4, "step": 40, "state_loaded": True, "state_verified": True, "join_s": 2.5, "manifest": "03" * 32},
        t=T0 + 44,
    )
    ledgers["carol"].append(
        "state_synced", {"round": 4, "step": 40, "manifest": "03" * 32, "seconds": 1.2, "reason": "join"}, t=T0 + 44.5
    )
    ledgers["alice"].append("peer_replaced", {"round": 5, "left": [bob], "joined": [carol]}, t=T0 + 49)


def _hostile_entries(ledgers: dict[str, Ledger], ids: dict[str, Identity]) -> tuple[int, int]:
    """Entries the report must survive; returns (rejected receipts, malformed entries)."""
    alice = ledgers["alice"]
    forged = _receipt(
        ledgers["carol"],
        ids["carol"],
        round_number=5,
        members=sorted(ids[n].peer_id for n in ("alice", "carol")),
        samples=520,
    )
    forged["receipt"]["samples"] = 10**6
    alice.append("receipt", forged, t=T0 + 65)
    alice.append("receipt", {"receipt": 5, "signature": None}, t=T0 + 65)
    malformed = [
        ("round", {"round": 6, "group_size": "three", "bytes_sent": 1}),
        ("round", {"round": -1, "group_size": 2}),
        ("train", {"step": 60, "samples_per_s": "fast"}),
        ("val", {"round": 6, "val_loss": "NaN"}),
        ("checkpoint_sealed", {"step": 70, "digest": "ab" * 32, "signers": "everyone"}),
    ]
    for kind, body in malformed:
        alice.append(kind, body, t=T0 + 65)
    nested: dict = {"reason": "deep"}
    for _ in range(200):
        nested = {"inner": nested}
    alice.append("peer_replaced", {"round": 6, "left": [], "joined": [], "extra": nested}, t=T0 + 65.5)
    alice.append("custom.kind", {"note": EVIL_PEER}, t=T0 + 66)
    alice.append("record_rejected", {"what": EVIL_PEER, "reason": "bad signature", "count": 3}, t=T0 + 66)
    alice.append("failure", {"round": 6, "peer": EVIL_PEER, "phase": "</td><b>", "reason": "x"}, t=T0 + 66)
    return 2, len(malformed)


def _verified_work(ledgers: dict[str, Ledger], ids: dict[str, Identity]) -> int:
    """Carol checks alice twice and bob once (bob's work fails), re-checks a false accusation and excludes both
    bob and an accuser; returns the malformed work entries written."""
    alice, bob = ids["alice"].peer_id, ids["bob"].peer_id
    carol = ledgers["carol"]
    for r, prover, ok, reason in ((4, alice, True, "match"), (5, alice, True, "match"), (5, bob, False, "replay")):
        carol.append("work_check", {"round": r, "prover": prover, "ok": ok, "reason": reason}, t=T0 + 50 + r)
    carol.append("work_check", {"round": 5, "prover": bob, "ok": False, "reason": "inputs refused"}, t=T0 + 56)
    carol.append("work_excluded", {"peer": bob, "reason": "failed a replay check: replay differs"}, t=T0 + 56)
    carol.append("work_dispute", {"verdict": {"prover": alice}, "outcome": "verifier"}, t=T0 + 57)
    carol.append("work_excluded", {"peer": EVIL_PEER, "reason": "accused <b>alice</b> falsely"}, t=T0 + 57)
    carol.append("work_check", {"round": 6, "prover": alice, "ok": "yes", "reason": "match"}, t=T0 + 58)
    carol.append("work_dispute", {"verdict": {}, "outcome": "everyone"}, t=T0 + 58)
    return 2


def build_run(root: Path) -> SimRun:
    ids = {n: Identity.generate() for n in NAMES}
    ledgers = {
        n: Ledger(default_ledger_path(root, run=RUN, peer_id=ids[n].peer_id), identity=ids[n], run=RUN) for n in NAMES
    }
    expected: Counter = Counter()
    try:
        _lifecycle(ledgers, ids)
        for r in (1, 2, 3):
            _play_round(ledgers, ids, r, expected)
        ledgers["bob"].append(
            "train", {"step": 35, "round": 4, "loss": 2.3, "samples_per_s": 51.0, "samples": 64}, t=T0 + 36
        )  # and then bob is gone: no "stop"
        _failure_and_replacement(ledgers, ids)
        for r in (4, 5, 6):
            _play_round(ledgers, ids, r, expected)
        num_rejected, num_malformed = _hostile_entries(ledgers, ids)
        num_malformed += _verified_work(ledgers, ids)
        for n in ("alice", "carol"):
            ledgers[n].append("stop", {"step": 60, "round": 6, "signal": "SIGTERM"}, t=T0 + 70)
    finally:
        for ledger in ledgers.values():
            ledger.close()
    return SimRun(
        root=root,
        ids=ids,
        receipt_samples=dict(expected),
        num_rejected_receipts=num_rejected,
        num_malformed=num_malformed,
    )


@pytest.fixture(scope="module")
def sim(tmp_path_factory) -> SimRun:
    return build_run(tmp_path_factory.mktemp("ledgers"))


@pytest.fixture(scope="module")
def report(sim):
    return write_report(sim.root)


def _section(page: str, heading: str) -> str:
    """The HTML between the <h2> named ``heading`` and the next <h2>."""
    start = page.index(f"<h2>{heading}</h2>")
    end = page.find("<h2>", start + 1)
    return page[start : end if end >= 0 else len(page)]


def _row_with(section: str, *needles: str) -> str:
    rows = [row for row in re.split(r"<tr[ >]", section) if all(needle in row for needle in needles)]
    assert len(rows) == 1, f"expected one row with {needles!r}, found {len(rows)}"
    return rows[0]


def _check_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC), f"{path} is not a PNG"
    assert len(data) > MIN_PNG_BYTES, f"{path} is suspiciously small ({len(data)} bytes)"


def test_html_references_every_png_and_each_is_a_valid_png(sim, report):
    assert report.html == sim.root / "report.html" and report.html.is_file()
    page = report.html.read_text(encoding="utf-8")
    assert set(report.pngs) == set(PNG_NAMES)
    for key, name in PNG_NAMES.items():
        assert report.pngs[key] == sim.root / "report" / name
        assert f'src="report/{name}"' in page
        _check_png(report.pngs[key])
    assert "<script" not in page.lower() and "http://" not in page and "https://" not in page
    assert (sim.root / "report" / "summary.json").is_file()


def test_tables_show_every_peer_and_receipt_backed_samples(sim, report):
    page = report.html.read_text(encoding="utf-8")
    peers_table = _section(page, "Peers (one row per ledger)")
    contributions = _section(page, "Contributions backed by verified receipts")
    for name in NAMES:
        peer = sim.ids[name].peer_id
        assert "yes" in _row_with(peers_table, peer).rsplit("<td>", 1)[1]  # last column: ledger verified
        assert f"<td>{sim.receipt_samples[peer]:,}</td>" in _row_with(contributions, peer)
    assert f"{sim.num_rejected_receipts} rejected" in contributions
    by_peer = report.summary["contributions"][RUN]
    assert {p: c["samples"] for p, c in by_peer.items()} == sim.receipt_samples
    assert by_peer[sim.ids["carol"].peer_id]["rounds"] == 2
    assert sum(report.summary["receipts_rejected"].values()) == sim.num_rejected_receipts


def test_summary_counts_rounds_checkpoints_failures_and_the_vanished_peer(sim, report):
    run = report.summary["runs"][RUN]
    assert (run["peers"], run["rounds"], run["last_round"], run["sealed_checkpoints"]) == (3, 6, 6, 2)
    assert run["duration_s"] == pytest.approx(70.0)
    assert run["first_val_loss"] == pytest.approx(2.8) and run["last_val_loss"] == pytest.approx(1.7)
    assert (run["peers_stopped"], run["peers_vanished"]) == (2, 1)
    assert report.summary["skipped_entries"] == sim.num_malformed
    assert report.summary["tampered"] == []
    events = Counter((e["peer"], e["kind"]) for e in report.summary["events"])
    ids = {n: sim.ids[n].peer_id for n in NAMES}
    assert events[(ids["bob"], VANISHED)] == 1 and events[(ids["alice"], VANISHED)] == 0
    assert events[(ids["alice"], "failure")] == 2 and events[(ids["carol"], "state_synced")] == 1
    assert events[(ids["alice"], "peer_replaced")] == 2  # one of them deeply nested
    page = report.html.read_text(encoding="utf-8")
    assert page.count(VANISHED) >= 2  # the per-peer table and the events list
    checkpoints = _section(page, "Sealed checkpoints")
    assert "0303030303030303" in checkpoints and "0606060606060606" in checkpoints


def test_verified_work_shows_checks_disputes_and_who_was_excluded(sim, report):
    ids = {n: sim.ids[n].peer_id for n in NAMES}
    (work,) = report.summary["work"]
    assert work["peer"] == ids["carol"]
    counts = {k: work[k] for k in ("checks", "passed", "failed", "refused", "disputes", "confirmed", "liars")}
    assert counts == {"checks": 4, "passed": 2, "failed": 1, "refused": 1, "disputes": 1, "confirmed": 0, "liars": 1}
    assert set(work["excluded"]) == {ids["bob"], EVIL_PEER} and "replay differs" in work["excluded"][ids["bob"]]
    section = _section(report.html.read_text(encoding="utf-8"), "Verified work (spot-check replays)")
    assert "replay differs" in _row_with(section, "falsely")  # one row: carol's, with both exclusions
    assert "<b>alice</b>" not in section and "&lt;b&gt;alice&lt;/b&gt;" in section
    events = Counter((e["peer"], e["kind"]) for e in report.summary["events"])
    assert events[(ids["carol"], "work_excluded")] == 2


def test_every_ledger_string_is_escaped(report):
    page = report.html.read_text(encoding="utf-8")
    for evil in (EVIL_PEER, "</td><b>"):
        assert evil not in page
    events = _section(page, "Failure and recovery events")
    assert "&lt;img src=x onerror=alert(&#x27;peer&#x27;)&gt;" in _row_with(events, "record_rejected")
    assert "phase=&lt;/td&gt;&lt;b&gt;" in events


def _edit(path: Path, *statements: tuple[str, tuple]) -> None:
    """Run SQL on a ledger file behind the Ledger API's back, as an attacker with the file would."""
    with sqlite3.connect(path) as db:
        for sql, params in statements:
            assert db.execute(sql, params).rowcount >= 1, sql


def _forge(sim: SimRun, root: Path) -> Path:
    """Tamper bob's ledger, add two forged ledgers (a hostile owner name; an unreadable row), and cut
    the tail of carol's ledger back to before her round-6 receipt; returns carol's ledger."""
    bob = next(p for p in find_ledgers(root) if sim.ids["bob"].peer_id in p.name)
    # inflate bob's round-1 samples (110) in place: the digest no longer matches
    _edit(
        bob,
        (
            "UPDATE entries SET body = replace(body, '\"samples\":110', '\"samples\":99999') "
            "WHERE kind = 'round' AND body LIKE '%\"samples\":110,%'",
            (),
        ),
    )
    (root / "forged").mkdir()
    hostile, unreadable = root / "forged" / "hostile.sqlite", root / "forged" / "unreadable.sqlite"
    shutil.copy(next(p for p in find_ledgers(root) if sim.ids["carol"].peer_id in p.name), hostile)
    _edit(
        hostile,
        ("UPDATE meta SET value = ? WHERE key = 'peer'", (EVIL_PEER,)),
        ("UPDATE entries SET peer = ?", (EVIL_PEER,)),
    )
    shutil.copy(next(p for p in find_ledgers(root) if sim.ids["alice"].peer_id in p.name), unreadable)
    _edit(unreadable, ("UPDATE entries SET kind = ? WHERE seq = 3", (EVIL_KIND,)))
    # her round-6 receipt names her last "train" entry as her head; alice holds that receipt
    carol = next(p for p in find_ledgers(root) if sim.ids["carol"].peer_id in p.name)
    named = max(e.seq for e in read_entries(carol) if e.kind == "train")
    _edit(carol, ("DELETE FROM entries WHERE seq >= ?", (named,)))
    return carol


def test_tampered_and_forged_ledgers_are_reported_flagged_and_escaped(sim, tmp_path):
    root = tmp_path / "copy"
    shutil.copytree(sim.root, root, ignore=shutil.ignore_patterns("report", "report.html"))
    carol = _forge(sim, root)
    bob = sim.ids["bob"].peer_id
    assert sum(not verify_ledger(p).ok for p in find_ledgers(root)) == 3  # a cut tail is still a valid chain
    result = write_report(root)
    assert sorted(t["peer"] for t in result.summary["tampered"]) == sorted([EVIL_PEER, sim.ids["alice"].peer_id, bob])
    page = result.html.read_text(encoding="utf-8")
    banner = page[: page.index("<h2>Run summary</h2>")]
    assert "3 of 5 ledger(s) FAILED verification" in banner and bob in banner
    [cut] = result.summary["cross_check_problems"]
    assert str(carol) in cut and "tail was cut" in cut and "1 receipt(s) contradict" in banner
    peers_table = _section(page, "Peers (one row per ledger)")
    assert "<strong>NO</strong>: seq" in _row_with(peers_table, bob) and "digest mismatch" in _row_with(
        peers_table, bob
    )
    hostile_row = _row_with(peers_table, "&lt;img src=x")
    assert "<strong>NO</strong>" in hostile_row and "UNVERIFIED" in hostile_row
    events = _section(page, "Failure and recovery events")
    assert "UNVERIFIED ledger" in _row_with(events, "vanished", bob[-8:])
    assert "UNVERIFIED" not in _row_with(events, "vanished", sim.ids["carol"].peer_id[-8:])
    for evil in (EVIL_KIND, EVIL_PEER):
        assert evil not in page
    assert "<script" not in page.lower()
    # receipts stay signed evidence whatever the ledger that holds them: carol's total is unchanged
    assert (
        result.summary["contributions"][RUN][sim.ids["carol"].peer_id]["samples"]
        == sim.receipt_samples[sim.ids["carol"].peer_id]
    )
    for key in PNG_NAMES:
        _check_png(result.pngs[key])


def test_cli_writes_the_report_and_rejects_empty_or_missing_folders(sim, tmp_path, capsys):
    root = tmp_path / "cli"
    shutil.copytree(sim.root, root, ignore=shutil.ignore_patterns("report", "report.html"))
    out = tmp_path / "elsewhere" / "run.html"
    done = subprocess.run(
        [sys.executable, "-m", "swarm.report", str(root), "--out", str(out), "--title", "T<1>"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    page = out.read_text(encoding="utf-8")
    assert "<title>T&lt;1&gt;</title>" in page
    for name in PNG_NAMES.values():
        assert f'src="run/{name}"' in page
        _check_png(out.parent / "run" / name)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([str(empty)]) == 2
    assert "no swarm ledger" in capsys.readouterr().err
    assert main([str(tmp_path / "missing")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert main([str(root), "--out", str(tmp_path / "report.txt")]) == 2
    assert "must name an .html file" in capsys.readouterr().err
    flags = {s for a in build_parser()._actions for s in a.option_strings if s.startswith("--")}
    assert flags == {"--help", "--out", "--title"}  # frozen: a new flag is a decision


def test_figures_without_data_still_render_with_a_note(tmp_path):
    identity = Identity.generate()
    with_only_start = Ledger(
        default_ledger_path(tmp_path, run="quiet", peer_id=identity.peer_id), identity=identity, run="quiet"
    )
    with_only_start.append("start", {"pid": 1, "task": "charlm", "params": 1, "device": "cpu", "shard": 0}, t=T0)
    with_only_start.close()
    result = write_report(tmp_path)
    for key in PNG_NAMES:
        _check_png(result.pngs[key])
    assert result.summary["runs"]["quiet"]["rounds"] == 0
    assert result.summary["runs"]["quiet"]["first_val_loss"] is None
