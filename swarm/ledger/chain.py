"""A peer's evidence ledger: an append-only, hash-chained, signed log in one SQLite file per (peer, run).

Each entry holds its sequence number (1, 2, 3, ...), its time in integer milliseconds, a kind, the
owner's peer ID, the run, a JSON body (stored as exact text) and ``prev``, the digest of the entry
before it (:data:`GENESIS` for the first). Its own ``digest`` is the SHA-256 of those stored fields
(:func:`entry_digest`), signed by the owner with kind :data:`LEDGER_KIND` and the run bound in (see
:mod:`bootstrap.identity`). The owner's public key is recovered from its peer ID, so anyone holding the
file can check, trusting neither the file nor whoever handed it over (:func:`verify_ledger`), that
no entry was edited, inserted, deleted from the middle or reordered, and that the owner signed each.

What a hash chain cannot show on its own: a ledger whose newest entries were deleted (a truncated
tail), or replaced by its owner with a freshly signed different tail, is still a valid chain.
Receipts close that gap. The receipt a peer signs for each averaging round names its ledger head at
that moment (``ledger_seq``, ``ledger_head``; see :mod:`swarm.ledger.receipts`), and every other
member of the group records that receipt in its own ledger. ``python -m swarm.ledger verify`` with
several ledgers cross-checks each receipt against its signer's ledger
(:func:`swarm.ledger.receipts.cross_check`): the named entry must be there with that digest. So a
peer can hide or rewrite only the history that no other peer has witnessed.

Storage: SQLite in WAL mode, ``synchronous=NORMAL``, one transaction per append. A killed process
loses at most the entry it was writing; a power cut may lose the last few, never the chain's shape.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import numbers
import re
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bootstrap.envelope import JsonFields
from bootstrap.errors import StateError
from bootstrap.identity import Identity, public_key_from_peer_id, verify

LEDGER_KIND = "swarm/ledger"
"""Signature domain of ledger entries (``identity.sign(kind=LEDGER_KIND, run_id=run, payload=digest)``)."""
GENESIS = "0" * 64
"""The ``prev`` of entry 1, and the head of an empty ledger."""
LEDGER_SCHEMA = 1
"""Version of the file layout; other versions are refused."""
DEFAULT_LEDGER_DIR = Path("~/.swarm/ledgers")
"""Where peers keep their ledgers by default (``DIR/RUN/PEER_ID.sqlite``)."""
MAX_BODY_BYTES = 1 << 20
"""Largest JSON body one entry may hold."""

_FORMAT = "swarm-ledger"
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX128 = re.compile(r"[0-9a-f]{128}")
_KIND = re.compile(r"[A-Za-z0-9_./:-]{1,64}")
_MAX_NAME_CHARS = 128
_MAX_PROBLEMS = 20
_BUSY_TIMEOUT_S = 5.0
_COLUMNS = "seq, t_ms, kind, peer, run, body, prev, digest, signature"
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS entries (seq INTEGER PRIMARY KEY, t_ms INTEGER NOT NULL, kind TEXT NOT NULL, "
    "peer TEXT NOT NULL, run TEXT NOT NULL, body TEXT NOT NULL, prev TEXT NOT NULL, digest TEXT NOT NULL, "
    "signature TEXT NOT NULL)",
)


class LedgerError(StateError):
    """A ledger file is missing, unreadable, not a ledger, another peer's or run's, corrupt, or closed."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LedgerEntry(JsonFields):
    """One entry as stored (see the module docstring for what is digested and signed)."""

    seq: int
    """Position in the chain: 1, 2, 3, ... with no gaps."""
    t: float
    """Unix seconds (stored as integer milliseconds)."""
    kind: str
    """What happened, e.g. ``"round"``."""
    peer: str
    """The ledger owner's peer ID."""
    run: str
    """The run the ledger belongs to."""
    body: dict[str, Any]
    """The JSON object recorded (non-finite floats were stored as null)."""
    prev: str
    """Digest of the previous entry, :data:`GENESIS` for seq 1."""
    digest: str
    """SHA-256 hex of the stored fields (:func:`entry_digest`)."""
    signature: str
    """Hex Ed25519 signature of the digest by the owner."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LedgerVerdict:
    """What :func:`verify_ledger` found in one file."""

    path: Path
    """The file checked."""
    ok: bool
    """True when there is no problem at all."""
    peer: str
    """Owner named by the file ("" when it is not a readable ledger)."""
    run: str
    """Run named by the file ("" when it is not a readable ledger)."""
    num_entries: int
    """Rows read, good or bad."""
    head: tuple[int, str]
    """``(seq, digest)`` of the last row as stored; ``(0, GENESIS)`` when there is none."""
    problems: list[str] = field(default_factory=list)
    """Human-readable problems, oldest entry first (at most 20, then a count of the rest)."""
    first_bad_seq: int | None = None
    """Seq of the first entry with a problem; None when all entries are fine."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "ok": self.ok,
            "peer": self.peer,
            "run": self.run,
            "num_entries": self.num_entries,
            "head": list(self.head),
            "problems": list(self.problems),
            "first_bad_seq": self.first_bad_seq,
        }


def entry_digest(*, seq: int, t_ms: int, kind: str, peer: str, run: str, body_text: str, prev: str) -> str:
    """SHA-256 hex of the JSON array of an entry's stored fields: every field is one delimited JSON value."""
    fields = [seq, t_ms, kind, peer, run, body_text, prev]
    return hashlib.sha256(json.dumps(fields, separators=(",", ":"), ensure_ascii=True).encode("ascii")).hexdigest()


def encode_body(body: Mapping[str, Any]) -> str:
    """The exact JSON text stored for ``body``: sorted keys, no spaces, non-finite floats as null.

    Accepts None, bool, int, float (numpy scalars too), str, list, tuple and str-keyed mappings;
    TypeError names the first other value, ValueError a body over :data:`MAX_BODY_BYTES`.
    """
    if not isinstance(body, Mapping):
        raise TypeError(f"body must be a JSON object (a dict), got {type(body).__name__}")
    text = json.dumps(_jsonable(body, "body"), sort_keys=True, separators=(",", ":"), allow_nan=False)
    if len(text) > MAX_BODY_BYTES:
        raise ValueError(f"body is {len(text)} bytes of JSON, over the limit of {MAX_BODY_BYTES}")
    return text


def _jsonable(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        number = float(value)
        return number if math.isfinite(number) else None
    if isinstance(value, Mapping):
        for key in value:
            if not isinstance(key, str):
                raise TypeError(f"{where}: keys must be strings, got {key!r:.40}")
        return {key: _jsonable(item, f"{where}.{key}") for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item, f"{where}[{i}]") for i, item in enumerate(value)]
    raise TypeError(f"{where}: {type(value).__name__} is not JSON (use None, bool, int, float, str, list or dict)")


def default_ledger_path(directory: str | Path, *, run: str, peer_id: str) -> Path:
    """``DIRECTORY/RUN/PEER_ID.sqlite`` (``~`` expanded); ValueError if run or peer_id is not a safe file name."""
    for name, value in (("run", run), ("peer_id", peer_id)):
        _check_name(name, value)
        if value in (".", "..") or any(c in value for c in "/\\") or not value.isprintable():
            raise ValueError(f"{name} {value!r} cannot be used as a file name")
    return Path(directory).expanduser() / run / f"{peer_id}.sqlite"


def _check_name(name: str, value: Any) -> None:
    if not isinstance(value, str) or not 0 < len(value) <= _MAX_NAME_CHARS or "\x00" in value:
        raise ValueError(
            f"{name} must be a non-empty string of at most {_MAX_NAME_CHARS} chars without NUL, got {value!r:.140}"
        )


# ---------------------------------------------------------------------------------------------- writing


class Ledger:
    """The owner's append-only ledger of one run; thread-safe (one lock, one SQLite connection).

    Opening creates the folders and the file, or continues the chain already in it after checking
    that it names this peer and run and that its newest entry is intact; otherwise LedgerError (a
    full check of old entries is :func:`verify_ledger`'s job). Each :meth:`append` is committed
    before it returns.
    """

    def __init__(self, path: str | Path, *, identity: Identity, run: str):
        _check_name("run", run)
        self.path = Path(path).expanduser()
        self.peer = identity.peer_id
        self.run = run
        self._identity = identity
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = _connect_for_writing(self.path)
        try:
            self._claim()
            self._check_newest()
        except BaseException:
            self._conn.close()
            raise

    def __repr__(self) -> str:
        return f"Ledger({str(self.path)!r}, peer={self.peer!r}, run={self.run!r})"

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def append(self, kind: str, body: Mapping[str, Any], *, t: float | None = None) -> LedgerEntry:
        """Sign and commit one entry (``t`` defaults to now); returns it as stored.

        ValueError/TypeError for a bad kind, body or time (see :func:`encode_body`); LedgerError if
        the ledger is closed or the file cannot be written.
        """
        if not isinstance(kind, str) or not _KIND.fullmatch(kind):
            raise ValueError(f"kind must be 1..64 chars of [A-Za-z0-9_./:-], got {kind!r:.80}")
        body_text = encode_body(body)
        t_ms = _to_ms(time.time() if t is None else t)
        with self._lock, _write_transaction(self._open_connection(), self.path) as conn:
            seq, prev = _head(conn)
            seq += 1
            digest = entry_digest(
                seq=seq, t_ms=t_ms, kind=kind, peer=self.peer, run=self.run, body_text=body_text, prev=prev
            )
            signature = self._identity.sign(kind=LEDGER_KIND, run_id=self.run, payload=bytes.fromhex(digest)).hex()
            conn.execute(
                f"INSERT INTO entries ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (seq, t_ms, kind, self.peer, self.run, body_text, prev, digest, signature),
            )
        return LedgerEntry(
            seq=seq,
            t=t_ms / 1000,
            kind=kind,
            peer=self.peer,
            run=self.run,
            body=json.loads(body_text),
            prev=prev,
            digest=digest,
            signature=signature,
        )

    def head(self) -> tuple[int, str]:
        """``(seq, digest)`` of the newest entry; ``(0, GENESIS)`` when empty. LedgerError once closed."""
        with self._lock:
            try:
                return _head(self._open_connection())
            except sqlite3.Error as e:
                raise LedgerError(f"cannot read ledger {self.path}: {e}") from None

    def close(self) -> None:
        """Close the file; idempotent. Appending afterwards raises LedgerError."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def _open_connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise LedgerError(f"ledger {self.path} is closed")
        return self._conn

    def _claim(self) -> None:
        """Create the tables and meta of a new file, or check an existing file's owner and run."""
        with _write_transaction(self._open_connection(), self.path) as conn:
            tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if not tables:
                for statement in _SCHEMA:
                    conn.execute(statement)
                meta = {"format": _FORMAT, "schema": str(LEDGER_SCHEMA), "peer": self.peer, "run": self.run}
                conn.executemany("INSERT INTO meta (key, value) VALUES (?, ?)", meta.items())
            peer, run = _read_meta(conn, self.path)
        if peer != self.peer:
            raise LedgerError(
                f"ledger {self.path} belongs to peer {peer}, not to this peer {self.peer}; "
                f"each peer keeps its own file (see default_ledger_path)"
            )
        if run != self.run:
            raise LedgerError(
                f"ledger {self.path} belongs to run {run!r}, not {self.run!r}; "
                f"each run keeps its own file (see default_ledger_path)"
            )

    def _check_newest(self) -> None:
        try:
            row = (
                self._open_connection().execute(f"SELECT {_COLUMNS} FROM entries ORDER BY seq DESC LIMIT 1").fetchone()
            )
        except sqlite3.Error as e:
            raise LedgerError(f"cannot read ledger {self.path}: {e}") from None
        problems = (
            []
            if row is None
            else _entry_problems(row, peer=self.peer, run=self.run, public_key=self._identity.public_key)
        )
        if problems:
            raise LedgerError(
                f"ledger {self.path} is corrupt at its newest entry ({problems[0]}); "
                f"move it aside to start a new one, and keep it as evidence"
            )


def _connect_for_writing(path: Path) -> sqlite3.Connection:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=_BUSY_TIMEOUT_S)
    except (OSError, sqlite3.Error) as e:
        raise LedgerError(f"cannot open ledger {path}: {e}") from None
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
    except sqlite3.Error as e:
        conn.close()
        raise LedgerError(f"cannot open ledger {path}: {e}; if it is not a ledger, move it aside") from None
    return conn


@contextlib.contextmanager
def _write_transaction(conn: sqlite3.Connection, path: Path) -> Iterator[sqlite3.Connection]:
    """BEGIN IMMEDIATE ... COMMIT, rolled back on any error; SQLite errors become LedgerError.

    IMMEDIATE takes the write lock before the head is read, so even two writers cannot fork the chain.
    """
    try:
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
            conn.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            raise
    except sqlite3.Error as e:
        raise LedgerError(f"cannot write ledger {path}: {e}") from None


def _head(conn: sqlite3.Connection) -> tuple[int, str]:
    row = conn.execute("SELECT seq, digest FROM entries ORDER BY seq DESC LIMIT 1").fetchone()
    return (0, GENESIS) if row is None else (row[0], row[1])


def _to_ms(t: Any) -> int:
    if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or not 0 <= t < 2**53 / 1000:
        raise ValueError(f"t must be finite unix seconds >= 0, got {t!r:.40}")
    return round(float(t) * 1000)


# ---------------------------------------------------------------------------------------------- reading


def find_ledgers(root: str | Path) -> list[Path]:
    """Every ``*.sqlite`` file under ``root`` (recursively) that is a swarm ledger, sorted.

    ``root`` may also be one file. A missing root, or one without ledgers, gives an empty list.
    """
    root = Path(root).expanduser()
    if root.is_file():
        candidates = [root]
    else:
        candidates = sorted(p for p in root.rglob("*.sqlite") if p.is_file()) if root.is_dir() else []
    return [path for path in candidates if _is_ledger(path)]


def _is_ledger(path: Path) -> bool:
    try:
        with _reader(path) as conn:
            _read_meta(conn, path)
    except LedgerError:
        return False
    return True


def read_entries(path: str | Path) -> list[LedgerEntry]:
    """All entries in seq order, without verification (see :func:`verify_ledger`).

    LedgerError if the file is missing, not a ledger, unreadable, or holds a malformed row.
    """
    path = Path(path).expanduser()
    with _reader(path) as conn:
        _read_meta(conn, path)
        try:
            rows = conn.execute(f"SELECT {_COLUMNS} FROM entries ORDER BY seq").fetchall()
        except sqlite3.Error as e:
            raise LedgerError(f"cannot read ledger {path}: {e}") from None
    return [_entry_from_row(row, path) for row in rows]


def _entry_from_row(row: tuple, path: Path) -> LedgerEntry:
    malformed = _malformed_fields(row)
    if malformed:
        raise LedgerError(f"ledger {path}: the row with seq {row[0]!r:.20} is malformed ({malformed})")
    seq, t_ms, kind, peer, run, body_text, prev, digest, signature = row
    return LedgerEntry(
        seq=seq,
        t=t_ms / 1000,
        kind=kind,
        peer=peer,
        run=run,
        body=json.loads(body_text),
        prev=prev,
        digest=digest,
        signature=signature,
    )


@contextlib.contextmanager
def _reader(path: Path) -> Iterator[sqlite3.Connection]:
    """A read-only connection (never creates the file); SQLite errors while opening become LedgerError."""
    if not path.is_file():
        raise LedgerError(f"no ledger file at {path}")
    try:
        conn = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True, timeout=_BUSY_TIMEOUT_S)
    except sqlite3.Error as e:
        raise LedgerError(f"cannot open ledger {path}: {e}") from None
    try:
        yield conn
    finally:
        conn.close()


def _read_meta(conn: sqlite3.Connection, path: Path) -> tuple[str, str]:
    """``(peer, run)`` from the meta table; LedgerError if the file is not a ledger of this schema."""
    try:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        meta = dict(conn.execute("SELECT key, value FROM meta").fetchall()) if "meta" in tables else {}
    except sqlite3.Error as e:
        raise LedgerError(f"{path} is not a readable SQLite file ({e})") from None
    if meta.get("format") != _FORMAT or "entries" not in tables:
        raise LedgerError(f"{path} is an SQLite file but not a swarm ledger")
    if meta.get("schema") != str(LEDGER_SCHEMA):
        raise LedgerError(f"ledger {path} has schema {meta.get('schema')!r:.20}; this version reads {LEDGER_SCHEMA}")
    peer, run = meta.get("peer"), meta.get("run")
    if not isinstance(peer, str) or not isinstance(run, str):
        raise LedgerError(f"ledger {path} does not name its peer and run")
    return peer, run


# ---------------------------------------------------------------------------------------------- verifying


def verify_ledger(path: str | Path) -> LedgerVerdict:
    """Check a whole ledger file; never raises on its content (problems are returned).

    Finds edited entries (digest mismatch), deleted, inserted or reordered ones (seq gaps, ``prev``
    not naming the previous digest), entries not signed by the owner (forged, or re-signed by another
    key), rows naming another peer or run, a file named after another peer, and files that are not
    ledgers. It cannot see a truncated tail: see the module docstring.
    """
    path = Path(path).expanduser()
    try:
        with _reader(path) as conn:
            peer, run = _read_meta(conn, path)
            check = _ChainCheck(path=path, peer=peer, run=run)
            try:
                for row in conn.execute(f"SELECT {_COLUMNS} FROM entries ORDER BY seq"):
                    check.feed(row)
            except sqlite3.Error as e:
                check.add(check.expected_seq, f"the rest of the file is unreadable ({e})")
    except LedgerError as e:
        return LedgerVerdict(path=path, ok=False, peer="", run="", num_entries=0, head=(0, GENESIS), problems=[str(e)])
    return check.verdict()


class _ChainCheck:
    """Walks a ledger's rows in seq order and collects problems."""

    def __init__(self, *, path: Path, peer: str, run: str):
        self.path, self.peer, self.run = path, peer, run
        self.expected_seq, self.prev = 1, GENESIS
        self.num_entries, self.head = 0, (0, GENESIS)
        self.problems: list[str] = []
        self.num_problems = 0
        self.first_bad_seq: int | None = None
        try:
            self.public_key: bytes | None = public_key_from_peer_id(peer)
        except ValueError:
            self.public_key = None
            self.add(None, f"the ledger's owner {peer!r:.140} is not an Ed25519 peer ID: no entry can be checked")
        if path.stem != peer and _is_peer_id(path.stem):
            self.add(None, f"the file is named after peer {path.stem} but belongs to {peer}")

    def add(self, seq: int | None, problem: str) -> None:
        self.num_problems += 1
        if seq is not None and self.first_bad_seq is None:
            self.first_bad_seq = seq
        if len(self.problems) < _MAX_PROBLEMS:
            self.problems.append(problem if seq is None else f"seq {seq}: {problem}")

    def feed(self, row: tuple) -> None:
        self.num_entries += 1
        seq = row[0] if type(row[0]) is int else self.expected_seq
        problems = _chain_problems(row, expected_seq=self.expected_seq, prev=self.prev)
        problems += _entry_problems(row, peer=self.peer, run=self.run, public_key=self.public_key)
        for problem in problems:
            self.add(seq, problem)
        self.expected_seq = seq + 1
        self.prev = row[7] if isinstance(row[7], str) else ""
        self.head = (seq, self.prev)

    def verdict(self) -> LedgerVerdict:
        problems = list(self.problems)
        if self.num_problems > len(problems):
            problems.append(f"... and {self.num_problems - len(problems)} more problem(s)")
        return LedgerVerdict(
            path=self.path,
            ok=not problems,
            peer=self.peer,
            run=self.run,
            num_entries=self.num_entries,
            head=self.head,
            problems=problems,
            first_bad_seq=self.first_bad_seq,
        )


def _chain_problems(row: tuple, *, expected_seq: int, prev: str) -> list[str]:
    problems = []
    if row[0] != expected_seq:
        missing = " (entries were deleted)" if type(row[0]) is int and row[0] > expected_seq else ""
        problems.append(f"found where seq {expected_seq} was expected{missing}")
    if row[6] != prev:
        problems.append(
            "prev does not name the digest of the entry before it (an entry was deleted, inserted or reordered)"
        )
    return problems


def _entry_problems(row: tuple, *, peer: str, run: str, public_key: bytes | None) -> list[str]:
    """Problems of one row on its own: format, owner, run, digest, signature."""
    malformed = _malformed_fields(row)
    if malformed:
        return [f"malformed row ({malformed})"]
    seq, t_ms, kind, row_peer, row_run, body_text, prev, digest, signature = row
    problems = []
    if row_peer != peer:
        problems.append(f"names peer {row_peer!r:.140}, not the ledger's owner {peer}")
    if row_run != run:
        problems.append(f"names run {row_run!r:.140}, not the ledger's run {run!r}")
    if (
        entry_digest(seq=seq, t_ms=t_ms, kind=kind, peer=row_peer, run=row_run, body_text=body_text, prev=prev)
        != digest
    ):
        problems.append("digest mismatch: the entry was edited after it was written")
    if public_key is not None and not verify(
        public_key=public_key,
        kind=LEDGER_KIND,
        run_id=run,
        payload=bytes.fromhex(digest),
        signature=bytes.fromhex(signature),
    ):
        problems.append("signature does not verify: forged, or signed by a key other than the owner's")
    return problems


def _malformed_fields(row: tuple) -> str:
    """A description of the fields of a raw row that have the wrong type or format ("" when none)."""
    seq, t_ms, kind, peer, run, body_text, prev, digest, signature = row
    bad = [
        name
        for name, ok in (
            ("seq", type(seq) is int and seq >= 1),
            ("t_ms", type(t_ms) is int and t_ms >= 0),
            ("kind", isinstance(kind, str) and _KIND.fullmatch(kind)),
            ("peer", isinstance(peer, str)),
            ("run", isinstance(run, str)),
            ("prev", isinstance(prev, str) and _HEX64.fullmatch(prev)),
            ("digest", isinstance(digest, str) and _HEX64.fullmatch(digest)),
            ("signature", isinstance(signature, str) and _HEX128.fullmatch(signature)),
            ("body", _is_json_object(body_text)),
        )
        if not ok
    ]
    return ", ".join(bad)


def _is_json_object(text: Any) -> bool:
    if not isinstance(text, str) or len(text) > MAX_BODY_BYTES:
        return False
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


def _is_peer_id(text: str) -> bool:
    try:
        public_key_from_peer_id(text)
    except ValueError:
        return False
    return True
