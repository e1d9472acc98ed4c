"""`python -m swarm.report DIR [--out PATH] [--title T]`: an HTML report of a run, built from its peers' ledgers.

Reads every ledger under DIR (:func:`swarm.ledger.chain.find_ledgers`), verifies each hash chain
(:func:`swarm.ledger.chain.verify_ledger`) and writes ``DIR/report.html`` with its PNG figures in
``DIR/report/`` (beside the HTML, named after it), plus ``summary.json`` there for scripts. The HTML
has no scripts and loads nothing from the network.

Ledger contents are untrusted input. Every field is type-checked before use: an entry that fails is
skipped and counted, never fatal. Every string taken from a ledger is HTML-escaped, and plot labels
are reduced to a plain character set. A ledger that fails verification is still shown, flagged at
the top of the page and in every table that draws on it. Contributions are counted only from
receipts whose signatures verify (:func:`swarm.ledger.receipts.verify_receipt`).

:func:`write_report` is the in-process API (the demo calls it); the CLI is a thin wrapper that exits 2
when DIR does not exist or holds no ledger.
"""

from __future__ import annotations

import argparse
import datetime
import html
import json
import math
import os
import sqlite3
import sys
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bootstrap.errors import ConfigError
from swarm._private import plots
from swarm.ledger.chain import LedgerEntry, LedgerError, LedgerVerdict, find_ledgers, read_entries, verify_ledger
from swarm.ledger.receipts import ReceiptRejected, SignedReceipt, contributions, cross_check, verify_receipt

PNG_NAMES: dict[str, str] = {
    "val_loss": "val_loss.png",
    "samples_per_s": "samples_per_s.png",
    "group_sizes": "group_sizes.png",
    "timeline": "timeline.png",
    "bytes": "bytes.png",
}
"""Figure key -> file name inside the report's PNG folder (fixed, so scripts and tests can find them)."""

TIMELINE_KINDS = (
    "start",
    "joined",
    "state_synced",
    "failure",
    "peer_replaced",
    "checkpoint_sealed",
    "record_rejected",
    "diverging",
    "work_excluded",
    "work_refused",
    "stop",
)
"""Entry kinds drawn on the failure and recovery timeline and listed in the events table."""
VANISHED = "vanished (killed?)"
"""Pseudo-event at the last entry of a ledger that has no "stop" entry."""

_MAX_ABS_NUMBER = 1e15
_INT63 = 1 << 63
_MAX_TEXT_CHARS = 80
_MAX_DETAIL_CHARS = 300
_MAX_DETAIL_KEYS = 12
_MAX_TAIL_CHARS = 8
_MAX_DETAIL_DEPTH = 3
_MAX_EVENT_ROWS = 500
_MAX_KIND_ROWS = 50
_GROUP_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")


class ReportInputError(ConfigError):
    """The report cannot be made: the folder is missing, holds no ledger, or ``out`` is not an .html path."""


class _Malformed(ValueError):
    """An entry's body lacks a field or has one of the wrong type; the entry is skipped."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ReportResult:
    """What :func:`write_report` wrote."""

    html: Path
    """The HTML report."""
    pngs: dict[str, Path]
    """Figure key (see PNG_NAMES) -> PNG path; every key is always present."""
    summary: dict[str, Any]
    """JSON-ready summary: runs, peers, contributions, checkpoints, tampered ledgers, skipped entries."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RoundRow:
    """The fields of one "round" entry that the report uses."""

    t: float
    """Unix seconds of the entry."""
    round: int
    """Round number."""
    group_size: int
    """Peers in the averaging group."""
    bytes_sent: int
    """Bytes this peer sent in the round."""
    bytes_received: int
    """Bytes this peer received in the round."""
    samples: int
    """Samples this peer trained on in the round (self-reported)."""
    samples_per_s: float | None
    """Training throughput, None when not reported."""
    val_loss: float | None
    """Validation loss after the round, None when not measured (or NaN)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Event:
    """One failure/recovery event (an entry of a TIMELINE_KINDS kind, or VANISHED)."""

    t: float
    """Unix seconds."""
    kind: str
    """Entry kind, or VANISHED."""
    detail: str
    """Short text made from the entry body (unescaped; escape before display)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Sealed:
    """One "checkpoint_sealed" entry."""

    t: float
    """Unix seconds."""
    step: int
    """Training step of the sealed state."""
    digest: str
    """Manifest digest (as recorded; unescaped)."""
    num_signers: int
    """Number of signers listed."""
    metrics: str
    """The metrics as "key=value" text (unescaped)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PeerLedger:
    """Everything the report took from one ledger file."""

    path: Path
    """The ledger file."""
    peer: str
    """The ledger owner's peer id (as recorded; untrusted when not verified)."""
    run: str
    """Run name (as recorded)."""
    verified: bool
    """The hash chain and every signature verified."""
    problem: str | None
    """The first verification problem, None when verified."""
    num_entries: int
    """Entries read."""
    first_t: float | None
    """Unix seconds of the first usable entry."""
    last_t: float | None
    """Unix seconds of the last usable entry."""
    stopped: bool
    """The ledger holds a "stop" entry."""
    vanished: bool
    """The ledger has entries but no "stop": the peer was killed, crashed, or is still running."""
    vals: tuple[tuple[float, float], ...]
    """(unix seconds, validation loss) from "val" and "round" entries, by time."""
    train_rates: tuple[tuple[float, float], ...]
    """(unix seconds, samples/s) from "train" entries, by time."""
    rounds: tuple[RoundRow, ...]
    """"round" entries, by time."""
    events: tuple[Event, ...]
    """Timeline events, by time, ending with VANISHED when there is no "stop"."""
    sealed: tuple[Sealed, ...]
    """"checkpoint_sealed" entries."""
    receipts: tuple[SignedReceipt, ...]
    """"receipt" entries whose signature verified."""
    receipt_rejections: Counter[str]
    """Rejected "receipt" entries by reason."""
    kinds: Counter[str]
    """Entries by kind (kinds truncated to a bounded length)."""
    skipped: Counter[str]
    """Skipped entries by reason."""
    work: dict[str, Any]
    """Verified work (``work_check``, ``work_dispute``, ``work_excluded``, ``work_refused`` entries): counts by outcome
    (:data:`WORK_COUNTS`) and ``"excluded"``, peer -> reason."""


WORK_COUNTS = ("checks", "passed", "failed", "refused", "disputes", "confirmed", "liars")
"""Verified-work figures per ledger: checks this peer replayed and how they ended; re-checks of published
accusations (disputes) that confirmed the prover failed, or showed the accuser lied."""


@dataclass(kw_only=True)
class _Collector:
    """Mutable accumulator while one ledger is read; frozen into a PeerLedger at the end."""

    run: str
    times: list[float] = field(default_factory=list)
    vals: list[tuple[float, float]] = field(default_factory=list)
    train_rates: list[tuple[float, float]] = field(default_factory=list)
    rounds: list[RoundRow] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    sealed: list[Sealed] = field(default_factory=list)
    receipts: list[SignedReceipt] = field(default_factory=list)
    receipt_rejections: Counter[str] = field(default_factory=Counter)
    kinds: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    work: Counter[str] = field(default_factory=Counter)
    excluded: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------- typed access to untrusted bodies


def _int(body: dict, key: str, *, default: int | None = None) -> int:
    """A non-negative int below 2**63; ``default`` when absent (if given); _Malformed otherwise."""
    if key not in body and default is not None:
        return default
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _INT63:
        raise _Malformed(f"{key}: expected a non-negative int")
    return value


def _number(body: dict, key: str, *, required: bool = False) -> float | None:
    """A finite number of sane magnitude; None when null/NaN (or absent and not required)."""
    if key not in body and not required:
        return None
    value = body.get(key, _Malformed)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Malformed(f"{key}: expected a number")
    if isinstance(value, float) and math.isnan(value):
        return None
    if not abs(value) <= _MAX_ABS_NUMBER:
        raise _Malformed(f"{key}: out of range")
    return float(value)


def _text(value: Any, *, limit: int = _MAX_TEXT_CHARS, depth: int = 0) -> str:
    """A short display text for any JSON value (unescaped); nesting is cut at a fixed depth."""
    if isinstance(value, str):
        text = value
    elif isinstance(value, float):
        text = f"{value:.4g}"
    elif isinstance(value, (bool, int)) or value is None:
        text = str(value)
    elif depth >= _MAX_DETAIL_DEPTH and isinstance(value, (list, dict)):
        text = "[...]" if isinstance(value, list) else "{...}"
    elif isinstance(value, list):
        text = ",".join(_tail(v, depth=depth + 1) for v in value[:4])
        text = f"[{text}{f',+{len(value) - 4}' if len(value) > 4 else ''}]"
    elif isinstance(value, dict):
        text = "{" + _details(value, limit=limit, depth=depth + 1) + "}"
    else:
        text = type(value).__name__
    return _cut(text, limit)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "~"


def _tail(value: Any, *, depth: int) -> str:
    """A list item: long strings (peer ids, digests) by their last characters, which tell them apart."""
    if isinstance(value, str) and len(value) > _MAX_TAIL_CHARS:
        return "~" + value[-_MAX_TAIL_CHARS:]
    return _text(value, limit=24, depth=depth)


def _details(body: dict, *, limit: int = _MAX_DETAIL_CHARS, depth: int = 0) -> str:
    """ "key=value" pairs of a body's first keys, bounded in length (unescaped)."""
    keys = sorted(k for k in body if isinstance(k, str))[:_MAX_DETAIL_KEYS]
    return _cut(" ".join(f"{_cut(k, 24)}={_text(body[k], depth=depth)}" for k in keys), limit)


# ---------------------------------------------------------------- one handler per entry kind


def _on_val(c: _Collector, entry: LedgerEntry) -> None:
    if "val_loss" not in entry.body:
        raise _Malformed("val_loss: missing")
    loss = _number(entry.body, "val_loss")
    if loss is not None:
        c.vals.append((entry.t, loss))


def _on_train(c: _Collector, entry: LedgerEntry) -> None:
    rate = _number(entry.body, "samples_per_s", required=True)
    if rate is not None:
        c.train_rates.append((entry.t, rate))


def _on_round(c: _Collector, entry: LedgerEntry) -> None:
    body = entry.body
    row = RoundRow(
        t=entry.t,
        round=_int(body, "round"),
        group_size=_int(body, "group_size"),
        bytes_sent=_int(body, "bytes_sent", default=0),
        bytes_received=_int(body, "bytes_received", default=0),
        samples=_int(body, "samples", default=0),
        samples_per_s=_number(body, "samples_per_s"),
        val_loss=_number(body, "val_loss"),
    )
    c.rounds.append(row)
    if row.val_loss is not None:
        c.vals.append((entry.t, row.val_loss))


def _on_receipt(c: _Collector, entry: LedgerEntry) -> None:
    try:
        c.receipts.append(verify_receipt(entry.body, run_id=c.run, counter=c.receipt_rejections))
    except ReceiptRejected:
        pass  # counted in c.receipt_rejections by verify_receipt
    except (ValueError, TypeError, KeyError, RecursionError) as e:  # a parser gap must not stop the report
        c.receipt_rejections[f"unparseable ({type(e).__name__})"] += 1


def _on_sealed(c: _Collector, entry: LedgerEntry) -> None:
    body = entry.body
    digest, signers, metrics = body.get("digest"), body.get("signers"), body.get("metrics", {})
    if not isinstance(digest, str) or not isinstance(signers, list) or not isinstance(metrics, dict):
        raise _Malformed("checkpoint_sealed: digest/signers/metrics mistyped")
    c.sealed.append(
        Sealed(
            t=entry.t,
            step=_int(body, "step"),
            digest=_text(digest, limit=128),
            num_signers=len(signers),
            metrics=_details(metrics, limit=160),
        )
    )
    _on_event(c, entry)


def _on_event(c: _Collector, entry: LedgerEntry) -> None:
    c.events.append(Event(t=entry.t, kind=entry.kind, detail=_details(entry.body)))


def _on_work_check(c: _Collector, entry: LedgerEntry) -> None:
    ok, reason = entry.body.get("ok"), entry.body.get("reason")
    if not isinstance(ok, bool) or not isinstance(reason, str):
        raise _Malformed("work_check: ok/reason mistyped")
    c.work["checks"] += 1
    c.work["passed" if ok else ("refused" if reason == "inputs refused" else "failed")] += 1


def _on_work_dispute(c: _Collector, entry: LedgerEntry) -> None:
    outcome = entry.body.get("outcome")
    if outcome not in ("prover", "verifier", "agree"):
        raise _Malformed("work_dispute: outcome")
    c.work["disputes"] += 1
    c.work["confirmed"] += outcome == "prover"
    c.work["liars"] += outcome == "verifier"


def _on_work_excluded(c: _Collector, entry: LedgerEntry) -> None:
    peer, reason = entry.body.get("peer"), entry.body.get("reason")
    if not isinstance(peer, str) or not isinstance(reason, str):
        raise _Malformed("work_excluded: peer/reason mistyped")
    if len(c.excluded) < _MAX_EVENT_ROWS:  # a refused member (require_verified) is kept out round by round
        prefix = "refused each round: " if entry.kind == "work_refused" else ""
        c.excluded[_text(peer, limit=128)] = prefix + _text(reason, limit=_MAX_DETAIL_CHARS)
    _on_event(c, entry)


_HANDLERS: dict[str, Callable[[_Collector, LedgerEntry], None]] = {
    "val": _on_val,
    "train": _on_train,
    "round": _on_round,
    "receipt": _on_receipt,
    "checkpoint_sealed": _on_sealed,
    **{
        kind: _on_event for kind in TIMELINE_KINDS if kind not in ("checkpoint_sealed", "work_excluded", "work_refused")
    },
    "work_check": _on_work_check,
    "work_dispute": _on_work_dispute,
    "work_excluded": _on_work_excluded,
    "work_refused": _on_work_excluded,
}


def _usable(entry: Any) -> bool:
    """The envelope fields have the types the handlers rely on (read_entries does not verify)."""
    t = getattr(entry, "t", None)
    return (
        isinstance(getattr(entry, "kind", None), str)
        and isinstance(getattr(entry, "body", None), dict)
        and isinstance(t, (int, float))
        and not isinstance(t, bool)
        and math.isfinite(t)
        and 0 <= t <= _MAX_ABS_NUMBER
    )


def _collect(c: _Collector, entries: Iterable[Any]) -> None:
    for entry in entries:
        if not _usable(entry):
            c.skipped["malformed entry envelope"] += 1
            continue
        c.kinds[_text(entry.kind, limit=_MAX_TEXT_CHARS)] += 1
        c.times.append(float(entry.t))
        handler = _HANDLERS.get(entry.kind)
        if handler is None:
            continue
        try:
            handler(c, entry)
        except _Malformed as e:
            c.skipped[f"{_text(entry.kind, limit=32)}: {e}"] += 1


# ---------------------------------------------------------------- reading and verifying ledgers


def _verify(path: Path) -> LedgerVerdict | str:
    """The verdict on a ledger, or why it could not even be checked."""
    try:
        return verify_ledger(path)
    except (LedgerError, OSError, sqlite3.Error, ValueError) as e:
        return f"cannot verify: {e}"


def _read(path: Path) -> tuple[list[Any], str | None]:
    try:
        return list(read_entries(path)), None
    except (LedgerError, OSError, sqlite3.Error, ValueError) as e:
        return [], f"cannot read: {e}"


@dataclass(frozen=True, kw_only=True, slots=True)
class _Loaded:
    """One ledger as read: what the report shows, plus what the receipt cross-check needs."""

    ledger: PeerLedger
    """What the report shows."""
    verdict: LedgerVerdict | None
    """verify_ledger's verdict; None when the file could not be checked."""
    entries: list[Any]
    """The entries as read (none when unreadable)."""


def _load(path: Path) -> _Loaded:
    verdict = _verify(path)
    entries, read_problem = _read(path)
    if isinstance(verdict, str):
        ok, problem, peer, run = False, verdict, "", ""
    else:
        ok, peer, run = bool(verdict.ok), str(verdict.peer or ""), str(verdict.run or "")
        problem = None if ok else (verdict.problems[0] if verdict.problems else "failed verification")
    if read_problem is not None:
        ok, problem = False, problem or read_problem
    peer = peer or next((e.peer for e in entries if isinstance(getattr(e, "peer", None), str)), path.stem)
    run = run or next((e.run for e in entries if isinstance(getattr(e, "run", None), str)), path.parent.name)
    c = _Collector(run=run)
    _collect(c, entries)
    ledger = _freeze(c, path=path, peer=peer, ok=ok, problem=problem, num_entries=len(entries))
    return _Loaded(ledger=ledger, verdict=None if isinstance(verdict, str) else verdict, entries=entries)


def load_ledger(path: Path) -> PeerLedger:
    """Read and verify one ledger; never raises on its content."""
    return _load(path).ledger


def _cross_check(loaded: list[_Loaded]) -> list[str]:
    """Receipts that name a ledger head their signer's ledger (if present here) does not hold.

    This catches what a hash chain cannot: a peer that cut or rewrote the tail of its own ledger.
    """
    pairs = [(x.verdict, x.entries) for x in loaded if x.verdict is not None and x.entries]
    try:
        return cross_check(pairs, counter=Counter())
    except (ValueError, TypeError, KeyError) as e:  # untrusted input must not stop the report
        return [f"the receipt cross-check could not run: {e}"]


def _freeze(c: _Collector, *, path: Path, peer: str, ok: bool, problem: str | None, num_entries: int) -> PeerLedger:
    events = sorted(c.events, key=lambda e: e.t)
    stopped = any(e.kind == "stop" for e in events)
    vanished = not stopped and bool(c.times)
    if vanished:
        events.append(Event(t=max(c.times), kind=VANISHED, detail='the ledger ends without a "stop" entry'))
    return PeerLedger(
        path=path,
        peer=peer,
        run=c.run,
        verified=ok,
        problem=problem,
        num_entries=num_entries,
        first_t=min(c.times, default=None),
        last_t=max(c.times, default=None),
        stopped=stopped,
        vanished=vanished,
        vals=tuple(sorted(c.vals)),
        train_rates=tuple(sorted(c.train_rates)),
        rounds=tuple(sorted(c.rounds, key=lambda r: r.t)),
        events=tuple(events),
        sealed=tuple(c.sealed),
        receipts=tuple(c.receipts),
        receipt_rejections=c.receipt_rejections,
        kinds=c.kinds,
        skipped=c.skipped,
        work={**{name: c.work[name] for name in WORK_COUNTS}, "excluded": dict(c.excluded)},
    )


# ---------------------------------------------------------------- summaries


def _label(ledger: PeerLedger, *, multi_run: bool) -> str:
    """Short plot label: the peer id's tail, the run when several, and a flag when unverified."""
    short = ledger.peer[-8:] if len(ledger.peer) > 8 else ledger.peer
    label = f"{ledger.run}/{short}" if multi_run else short
    return label if ledger.verified else f"{label} UNVERIFIED"


def _run_t0(ledgers: list[PeerLedger]) -> dict[str, float]:
    t0: dict[str, float] = {}
    for ledger in ledgers:
        if ledger.first_t is not None:
            t0[ledger.run] = min(t0.get(ledger.run, ledger.first_t), ledger.first_t)
    return t0


def _run_summary(run: str, ledgers: list[PeerLedger], num_sealed: int) -> dict[str, Any]:
    mine = [ledger for ledger in ledgers if ledger.run == run]
    firsts = [x.first_t for x in mine if x.first_t is not None]
    lasts = [x.last_t for x in mine if x.last_t is not None]
    round_numbers = {r.round for x in mine for r in x.rounds}
    vals = sorted(v for x in mine for v in x.vals)
    return {
        "run": run,
        "peers": len({x.peer for x in mine}),
        "ledgers": len(mine),
        "ledgers_verified": sum(x.verified for x in mine),
        "duration_s": (max(lasts) - min(firsts)) if firsts and lasts else None,
        "rounds": len(round_numbers),
        "last_round": max(round_numbers, default=None),
        "first_val_loss": vals[0][1] if vals else None,
        "last_val_loss": vals[-1][1] if vals else None,
        "sealed_checkpoints": num_sealed,
        "peers_stopped": sum(x.stopped for x in mine),
        "peers_vanished": sum(x.vanished for x in mine),
    }


def _peer_summary(ledger: PeerLedger, label: str) -> dict[str, Any]:
    return {
        "run": ledger.run,
        "peer": ledger.peer,
        "label": label,
        "path": str(ledger.path),
        "entries": ledger.num_entries,
        "first_t": ledger.first_t,
        "last_t": ledger.last_t,
        "rounds": len({r.round for r in ledger.rounds}),
        "samples": sum(r.samples for r in ledger.rounds),
        "bytes_sent": sum(r.bytes_sent for r in ledger.rounds),
        "bytes_received": sum(r.bytes_received for r in ledger.rounds),
        "verified": ledger.verified,
        "problem": ledger.problem,
        "stopped": ledger.stopped,
        "vanished": ledger.vanished,
        "skipped_entries": sum(ledger.skipped.values()),
        "skipped_by_reason": dict(ledger.skipped),
    }


def _work(ledgers: list[PeerLedger], labels: list[str]) -> list[dict[str, Any]]:
    """Verified work, one row per ledger that checked, disputed or excluded anything."""
    return [
        {"run": x.run, "peer": x.peer, "label": label, **x.work}
        for x, label in zip(ledgers, labels)
        if x.work["checks"] or x.work["disputes"] or x.work["excluded"]
    ]


def _contributions(ledgers: list[PeerLedger]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per run, per peer: contributions backed by verified receipts (deduplicated by swarm.ledger)."""
    by_run: dict[str, list[SignedReceipt]] = {}
    for ledger in ledgers:
        by_run.setdefault(ledger.run, []).extend(ledger.receipts)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for run, receipts in sorted(by_run.items()):
        out[run] = {
            peer: {key: value for key, value in c.to_dict().items() if key != "peer"}
            for peer, c in sorted(contributions(receipts).items())
        }
    return out


def _checkpoints(ledgers: list[PeerLedger]) -> list[dict[str, Any]]:
    """Sealed checkpoints, one row per (run, step, digest), with how many ledgers recorded each."""
    rows: dict[tuple[str, int, str], dict[str, Any]] = {}
    for ledger in ledgers:
        for s in ledger.sealed:
            row = rows.setdefault(
                (ledger.run, s.step, s.digest),
                {
                    "run": ledger.run,
                    "step": s.step,
                    "digest": s.digest,
                    "signers": s.num_signers,
                    "metrics": s.metrics,
                    "t": s.t,
                    "recorded_by": 0,
                    "only_unverified": True,
                },
            )
            row["recorded_by"] += 1
            row["only_unverified"] = row["only_unverified"] and not ledger.verified
    return sorted(rows.values(), key=lambda r: (r["run"], r["step"], r["t"]))


def _events(ledgers: list[PeerLedger], labels: list[str], t0: dict[str, float]) -> list[dict[str, Any]]:
    rows = [
        {
            "run": x.run,
            "peer": x.peer,
            "label": label,
            "t": e.t,
            "t_s": e.t - t0.get(x.run, e.t),
            "kind": e.kind,
            "detail": e.detail,
            "verified": x.verified,
        }
        for x, label in zip(ledgers, labels)
        for e in x.events
    ]
    return sorted(rows, key=lambda r: (r["run"], r["t"], r["label"]))


def summarize(ledgers: list[PeerLedger], *, cross_check_problems: list[str] | None = None) -> dict[str, Any]:
    """The JSON-ready summary of :class:`ReportResult` (everything the tables show)."""
    multi_run = len({x.run for x in ledgers}) > 1
    labels = [_label(x, multi_run=multi_run) for x in ledgers]
    checkpoints = _checkpoints(ledgers)
    rejections: Counter[str] = sum((x.receipt_rejections for x in ledgers), Counter())
    kinds: Counter[str] = sum((x.kinds for x in ledgers), Counter())
    return {
        "runs": {
            run: _run_summary(run, ledgers, sum(c["run"] == run for c in checkpoints))
            for run in sorted({x.run for x in ledgers})
        },
        "peers": [_peer_summary(x, label) for x, label in zip(ledgers, labels)],
        "tampered": [
            {"path": str(x.path), "peer": x.peer, "run": x.run, "problem": x.problem} for x in ledgers if not x.verified
        ],
        "contributions": _contributions(ledgers),
        "receipts_verified": sum(len(x.receipts) for x in ledgers),
        "receipts_rejected": dict(rejections),
        "checkpoints": checkpoints,
        "events": _events(ledgers, labels, _run_t0(ledgers)),
        "work": _work(ledgers, labels),
        "entry_kinds": dict(kinds.most_common()),
        "skipped_entries": sum(sum(x.skipped.values()) for x in ledgers),
        "cross_check_problems": list(cross_check_problems or []),
    }


# ---------------------------------------------------------------- figures


def _relative(points: Iterable[tuple[float, float]], t0: float) -> tuple[tuple[float, float], ...]:
    return tuple((t - t0, y) for t, y in points)


def _cumulative_bytes(rounds: tuple[RoundRow, ...], t0: float, unit: int) -> tuple[tuple[float, float], ...]:
    total, points = 0, []
    for r in rounds:
        total += r.bytes_sent + r.bytes_received
        points.append((r.t - t0, total / unit))
    return tuple(points)


def _group_points(rounds: tuple[RoundRow, ...], offset: float) -> tuple[tuple[float, float], ...]:
    return tuple(sorted((r.round + offset, float(r.group_size)) for r in rounds))


def _figure_series(ledgers: list[PeerLedger], labels: list[str], *, bytes_unit: int) -> dict[str, list[plots.Series]]:
    t0 = _run_t0(ledgers)
    width = 0.6 / max(len(ledgers), 1)
    out: dict[str, list[plots.Series]] = {"val_loss": [], "samples_per_s": [], "group_sizes": [], "bytes": []}
    for i, (x, label) in enumerate(zip(ledgers, labels)):
        start = t0.get(x.run, 0.0)
        out["val_loss"].append(plots.Series(label=label, color_index=i, points=_relative(x.vals, start)))
        out["samples_per_s"].append(plots.Series(label=label, color_index=i, points=_relative(x.train_rates, start)))
        rates = ((r.t, r.samples_per_s) for r in x.rounds if r.samples_per_s is not None)
        out["samples_per_s"].append(
            plots.Series(label=None, color_index=i, points=_relative(rates, start), linestyle="", marker="x")
        )
        out["group_sizes"].append(
            plots.Series(
                label=label,
                color_index=i,
                points=_group_points(x.rounds, (i - (len(ledgers) - 1) / 2) * width),
                linestyle="",
                marker=_GROUP_MARKERS[i % len(_GROUP_MARKERS)],
            )
        )
        out["bytes"].append(
            plots.Series(
                label=label,
                color_index=i,
                points=_cumulative_bytes(x.rounds, start, bytes_unit),
                drawstyle="steps-post",
            )
        )
    return out


_AXES = {
    "val_loss": plots.Axes(
        title="Validation loss per peer",
        xlabel="seconds since the run's first entry",
        ylabel="validation loss",
        empty_note='no data: no "val" or "round" entry with a val_loss',
    ),
    "samples_per_s": plots.Axes(
        title="Training throughput per peer (line: train entries, x: rounds)",
        xlabel="seconds since the run's first entry",
        ylabel="samples/s",
        empty_note='no data: no "train" or "round" entry with samples_per_s',
    ),
    "group_sizes": plots.Axes(
        title="Averaging group size per round",
        xlabel="round",
        ylabel="group size (peers)",
        empty_note='no data: no "round" entries',
    ),
    "timeline": plots.Axes(
        title="Failures and recovery",
        xlabel="seconds since the run's first entry",
        ylabel="peer",
        empty_note="no data: no ledger entries",
    ),
    "bytes": plots.Axes(
        title="Bytes on the wire (sent + received, cumulative)",
        xlabel="seconds since the run's first entry",
        ylabel="bytes",
        empty_note='no data: no "round" entries',
    ),
}


def _lanes(ledgers: list[PeerLedger], labels: list[str]) -> list[plots.Lane]:
    t0 = _run_t0(ledgers)
    lanes = []
    for i, (x, label) in enumerate(zip(ledgers, labels)):
        start = t0.get(x.run, 0.0)
        span = (x.first_t - start, x.last_t - start) if x.first_t is not None and x.last_t is not None else None
        lanes.append(
            plots.Lane(label=label, color_index=i, span=span, markers=tuple((e.t - start, e.kind) for e in x.events))
        )
    return lanes


def draw_figures(ledgers: list[PeerLedger], labels: list[str], folder: Path) -> dict[str, Path]:
    """Write every PNG of PNG_NAMES into ``folder``; figures without data carry a "no data" note."""
    paths = {key: folder / name for key, name in PNG_NAMES.items()}
    most_bytes = max((sum(r.bytes_sent + r.bytes_received for r in x.rounds) for x in ledgers), default=0)
    bytes_unit, unit_name = _bytes_unit(most_bytes)
    axes = {**_AXES, "bytes": replace(_AXES["bytes"], ylabel=unit_name)}
    for key, series in _figure_series(ledgers, labels, bytes_unit=bytes_unit).items():
        plots.series_plot(paths[key], axes=axes[key], series=series)
    plots.timeline_plot(paths["timeline"], axes=axes["timeline"], lanes=_lanes(ledgers, labels))
    return paths


# ---------------------------------------------------------------- HTML


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _fmt(value: Any) -> str:
    """Display text of a number or None (unescaped)."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else "-"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _fmt_bytes(num_bytes: int) -> str:
    value, unit = _bytes_unit(num_bytes)
    return f"{num_bytes / value:.3g} {unit}" if num_bytes else "0"


def _bytes_unit(num_bytes: float) -> tuple[int, str]:
    """The largest binary unit not above ``num_bytes`` (at least bytes)."""
    for power, unit in ((3, "GiB"), (2, "MiB"), (1, "KiB")):
        if num_bytes >= 1024**power:
            return 1024**power, unit
    return 1, "B"


def _fmt_time(t: float | None) -> str:
    if t is None:
        return "-"
    try:
        return datetime.datetime.fromtimestamp(t, tz=datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (OverflowError, OSError, ValueError):
        return "?"


def _table(headers: list[str], rows: list[list[str]], *, row_classes: list[str] | None = None) -> str:
    """An HTML table; ``rows`` cells are already-escaped HTML."""
    if not rows:
        return '<p class="note">none</p>'
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    classes = row_classes or [""] * len(rows)
    body = "".join(
        f'<tr class="{cls}">' + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row, cls in zip(rows, classes)
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _tampered_banner(summary: dict[str, Any]) -> str:
    bad = summary["tampered"]
    if not bad:
        return (
            f'<p class="ok">All {len(summary["peers"])} ledger(s) verified: hash chains intact, '
            f"every entry signed by its owner.</p>"
        )
    items = "".join(
        f"<li><code>{_e(x['path'])}</code> (peer <code>{_e(x['peer'])}</code>, run "
        f"<code>{_e(x['run'])}</code>): {_e(x['problem'])}</li>"
        for x in bad
    )
    return (
        f'<div class="alert"><h2>&#9888; {len(bad)} of {len(summary["peers"])} ledger(s) FAILED '
        f"verification</h2><p>Their entries may have been edited, deleted, reordered or forged. They are "
        f"still shown below, marked UNVERIFIED, and must not be trusted.</p><ul>{items}</ul></div>"
    )


def _cross_check_banner(summary: dict[str, Any]) -> str:
    problems = summary["cross_check_problems"]
    if not problems:
        return ""
    items = "".join(f"<li>{_e(p)}</li>" for p in problems[:_MAX_EVENT_ROWS])
    return (
        f'<div class="alert"><h2>&#9888; {len(problems)} receipt(s) contradict their signer\'s ledger</h2>'
        f"<p>Another peer holds a receipt naming an entry of the signer's ledger that is missing or different "
        f"there: the signer cut or rewrote its own history after the fact.</p><ul>{items}</ul></div>"
    )


def _skipped_note(summary: dict[str, Any]) -> str:
    if not summary["skipped_entries"]:
        return ""
    reasons = Counter()
    for peer in summary["peers"]:
        reasons.update(peer["skipped_by_reason"])
    listed = ", ".join(f"{_e(reason)} &times;{n}" for reason, n in reasons.most_common(10))
    return (
        f'<p class="warn">{summary["skipped_entries"]} entr(y/ies) skipped because of missing or '
        f"mistyped fields: {listed}</p>"
    )


def _runs_html(summary: dict[str, Any]) -> str:
    headers = [
        "run",
        "peers",
        "ledgers verified",
        "duration (s)",
        "rounds",
        "last round",
        "first val loss",
        "last val loss",
        "sealed checkpoints",
        "stopped",
        "vanished",
    ]
    rows = [
        [
            _e(r["run"]),
            _fmt(r["peers"]),
            f"{r['ledgers_verified']}/{r['ledgers']}",
            _fmt(r["duration_s"]),
            _fmt(r["rounds"]),
            _fmt(r["last_round"]),
            _fmt(r["first_val_loss"]),
            _fmt(r["last_val_loss"]),
            _fmt(r["sealed_checkpoints"]),
            _fmt(r["peers_stopped"]),
            _fmt(r["peers_vanished"]),
        ]
        for r in summary["runs"].values()
    ]
    return _table(headers, rows)


def _peers_html(summary: dict[str, Any]) -> str:
    headers = [
        "label",
        "run",
        "peer",
        "entries",
        "first entry",
        "last entry",
        "rounds",
        "samples (self-reported)",
        "sent",
        "received",
        "stop",
        "skipped",
        "ledger verified",
    ]
    rows, classes = [], []
    for p in summary["peers"]:
        verified = "yes" if p["verified"] else f"<strong>NO</strong>: {_e(p['problem'])}"
        rows.append(
            [
                _e(p["label"]),
                _e(p["run"]),
                f"<code>{_e(p['peer'])}</code>",
                _fmt(p["entries"]),
                _fmt_time(p["first_t"]),
                _fmt_time(p["last_t"]),
                _fmt(p["rounds"]),
                _fmt(p["samples"]),
                _fmt_bytes(p["bytes_sent"]),
                _fmt_bytes(p["bytes_received"]),
                _stop_cell(p),
                _fmt(p["skipped_entries"]),
                verified,
            ]
        )
        classes.append("" if p["verified"] else "bad")
    return _table(headers, rows, row_classes=classes)


def _stop_cell(peer: dict[str, Any]) -> str:
    if peer["stopped"]:
        return "yes"
    return f"<strong>{_e(VANISHED)}</strong>" if peer["vanished"] else "-"


def _contributions_html(summary: dict[str, Any]) -> str:
    headers = ["run", "peer", "rounds", "receipts", "samples", "sent", "received", "first round", "last round"]
    rows = [
        [
            _e(run),
            f"<code>{_e(peer)}</code>",
            _fmt(c["rounds"]),
            _fmt(c["receipts"]),
            _fmt(c["samples"]),
            _fmt_bytes(c["bytes_sent"]),
            _fmt_bytes(c["bytes_received"]),
            _fmt(c["first_round"]),
            _fmt(c["last_round"]),
        ]
        for run, peers in summary["contributions"].items()
        for peer, c in peers.items()
    ]
    rejected = summary["receipts_rejected"]
    reasons = ", ".join(f"{_e(reason)} &times;{n}" for reason, n in sorted(rejected.items()))
    note = (
        f'<p class="note">{summary["receipts_verified"]} receipt entr(y/ies) verified; '
        f"{sum(rejected.values())} rejected{': ' + reasons if reasons else ''}.</p>"
    )
    return note + _table(headers, rows)


def _work_html(summary: dict[str, Any]) -> str:
    if not summary["work"]:
        return '<p class="note">No verified-work checks recorded (runs without <code>--verify-work</code>).</p>'
    headers = ["label", "run", *WORK_COUNTS, "excluded by this peer (reason)"]
    rows, classes = [], []
    for w in summary["work"]:
        excluded = "<br>".join(f"<code>{_e(p[-12:])}</code>: {_e(why)}" for p, why in w["excluded"].items()) or "-"
        rows.append([_e(w["label"]), _e(w["run"]), *(_fmt(w[name]) for name in WORK_COUNTS), excluded])
        classes.append("warn" if w["failed"] or w["liars"] or w["excluded"] else "")
    return _table(headers, rows, row_classes=classes)


def _checkpoints_html(summary: dict[str, Any]) -> str:
    headers = ["run", "step", "digest", "signers", "metrics", "recorded by (ledgers)"]
    rows, classes = [], []
    for c in summary["checkpoints"]:
        flag = " <strong>(only in UNVERIFIED ledgers)</strong>" if c["only_unverified"] else ""
        rows.append(
            [
                _e(c["run"]),
                _fmt(c["step"]),
                f"<code>{_e(c['digest'][:16])}</code>",
                _fmt(c["signers"]),
                _e(c["metrics"]),
                _fmt(c["recorded_by"]) + flag,
            ]
        )
        classes.append("bad" if c["only_unverified"] else "")
    return _table(headers, rows, row_classes=classes)


def _events_html(summary: dict[str, Any]) -> str:
    events = summary["events"]
    headers = ["run", "t (s)", "peer", "event", "detail"]
    rows, classes = [], []
    for ev in events[:_MAX_EVENT_ROWS]:
        warn = "" if ev["verified"] else " <strong>&#9888; UNVERIFIED ledger</strong>"
        rows.append(
            [_e(ev["run"]), _fmt(round(ev["t_s"], 1)), _e(ev["label"]), _e(ev["kind"]) + warn, _e(ev["detail"])]
        )
        classes.append("bad" if not ev["verified"] else ("warn" if ev["kind"] in ("failure", VANISHED) else ""))
    more = len(events) - _MAX_EVENT_ROWS
    tail = f'<p class="note">{more} more event(s) in summary.json</p>' if more > 0 else ""
    return _table(headers, rows, row_classes=classes) + tail


def _kinds_html(summary: dict[str, Any]) -> str:
    rows = [[_e(kind), _fmt(n)] for kind, n in list(summary["entry_kinds"].items())[:_MAX_KIND_ROWS]]
    return _table(["entry kind", "entries"], rows)


_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:0.5em 0 1.5em;font-size:0.85em}
th,td{border:1px solid #ccc;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f0f0f0} tr.bad{background:#fde2e2} tr.warn{background:#fff6dd}
.alert{border:3px solid #c00;background:#fde2e2;padding:0.5em 1em;margin:1em 0}
.ok{color:#060} .warn{color:#a60} .note{color:#555;font-size:0.9em}
img{max-width:100%;border:1px solid #ddd;margin:0.5em 0} code{font-size:0.9em}
"""


def _figures_html(pngs: dict[str, Path], html_dir: Path) -> str:
    parts = []
    for key, path in pngs.items():
        href = urllib.parse.quote(Path(os.path.relpath(path, html_dir)).as_posix())
        parts.append(
            f'<figure><img src="{_e(href)}" alt="{_e(_AXES[key].title)}">'
            f"<figcaption>{_e(_AXES[key].title)}</figcaption></figure>"
        )
    return "".join(parts)


def render_html(summary: dict[str, Any], *, title: str, pngs: dict[str, Path], html_dir: Path) -> str:
    """The report page (no scripts, no remote resources; every ledger string escaped)."""
    sections = [
        ("Run summary", _runs_html(summary)),
        ("Figures", _figures_html(pngs, html_dir)),
        ("Peers (one row per ledger)", _peers_html(summary)),
        ("Contributions backed by verified receipts", _contributions_html(summary)),
        ("Sealed checkpoints", _checkpoints_html(summary)),
        ("Verified work (spot-check replays)", _work_html(summary)),
        ("Failure and recovery events", _events_html(summary)),
        ("Entries by kind", _kinds_html(summary)),
    ]
    body = "".join(f"<h2>{_e(name)}</h2>{content}" for name, content in sections)
    generated = _fmt_time(datetime.datetime.now(tz=datetime.timezone.utc).timestamp())
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
        f"<style>{_CSS}</style></head><body><h1>{_e(title)}</h1>"
        f'<p class="note">Generated {_e(generated)} from {len(summary["peers"])} ledger(s).</p>'
        f"{_tampered_banner(summary)}{_cross_check_banner(summary)}{_skipped_note(summary)}{body}"
        f"</body></html>\n"
    )


# ---------------------------------------------------------------- entry points


def _png_folder(out: Path) -> Path:
    if out.suffix.lower() not in (".html", ".htm"):
        raise ReportInputError(f"--out must name an .html file, got {str(out)!r}")
    return out.with_suffix("")


def write_report(root: Path, *, out: Path | None = None, title: str | None = None) -> ReportResult:
    """Write the report of every ledger under ``root``: ``out`` (default root/report.html) and its PNGs.

    The PNGs go into a folder named after ``out`` without its suffix (root/report/ by default), with
    ``summary.json``. Raises ReportInputError when ``root`` is not a folder or holds no ledger.
    """
    root = Path(root).expanduser()
    if not root.is_dir():
        raise ReportInputError(f"{root} is not a folder; pass the folder holding the run's ledgers")
    paths = find_ledgers(root)
    if not paths:
        raise ReportInputError(f"no swarm ledger (*.sqlite) found under {root}; is this the --ledger-dir of the run?")
    out = Path(out).expanduser() if out is not None else root / "report.html"
    folder = _png_folder(out)
    folder.mkdir(parents=True, exist_ok=True)
    loaded = [_load(Path(p)) for p in paths]
    ledgers = [x.ledger for x in loaded]
    summary = summarize(ledgers, cross_check_problems=_cross_check(loaded))
    pngs = draw_figures(ledgers, [p["label"] for p in summary["peers"]], folder)
    title = title or "Swarm report: " + ", ".join(summary["runs"])
    out.write_text(render_html(summary, title=title, pngs=pngs, html_dir=out.parent), encoding="utf-8")
    (folder / "summary.json").write_text(json.dumps(summary, indent=1, default=str), encoding="utf-8")
    return ReportResult(html=out, pngs=pngs, summary=summary)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m swarm.report", description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path, help="folder holding the ledgers (searched recursively)")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="HTML file to write (default: DIR/report.html); its PNGs go in a folder beside it named after it",
    )
    parser.add_argument("--title", default=None, help="page title (default: names the run(s))")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = write_report(args.dir, out=args.out, title=args.title)
    except ReportInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = result.summary
    print(f"wrote {result.html} and {len(result.pngs)} figures in {result.html.with_suffix('')}/")
    print(
        f"{len(summary['peers'])} ledger(s), {summary['receipts_verified']} verified receipt entries, "
        f"{summary['skipped_entries']} skipped entries"
    )
    for bad in summary["tampered"]:
        print(_printable(f"WARNING: ledger {bad['path']} failed verification: {bad['problem']}"), file=sys.stderr)
    for problem in summary["cross_check_problems"]:
        print(_printable(f"WARNING: {problem}"), file=sys.stderr)
    return 0


def _printable(text: str) -> str:
    """``text`` without control characters: ledger strings must not drive the terminal."""
    return "".join(ch if ch.isprintable() else "?" for ch in text)


if __name__ == "__main__":
    sys.exit(main())
