"""`python -m swarm.ledger verify|receipts|show`: check and read peers' evidence ledgers.

``verify PATH_OR_DIR... [--json]`` checks every ledger given (a folder: every ledger under it), then
cross-checks each receipt found against its signer's ledger when that ledger is among those given,
which catches a peer that cut or rewrote its own history. ``receipts --run NAME [--dir DIR]`` sums
each peer's contribution from the verified receipts in the run's ledgers. ``show PATH`` prints
entries (unverified). Exit status: 0 ok, 1 a ledger or a cross-check failed, 2 bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from bootstrap.cli import command_parser
from swarm.ledger.chain import (
    DEFAULT_LEDGER_DIR,
    LedgerEntry,
    LedgerError,
    LedgerVerdict,
    find_ledgers,
    read_entries,
    verify_ledger,
)
from swarm.ledger.receipts import (
    Contribution,
    SignedReceipt,
    contributions,
    cross_check,
    receipt_key,
    verified_receipts,
)

_MAX_CELL_CHARS = 120


class _BadInput(Exception):
    """The command cannot run on what it was given (exit status 2)."""


_COMMANDS = {
    "verify": "check ledgers' hash chains and signatures, and cross-check receipts",
    "receipts": "per-peer contributions backed by verified receipts",
    "show": "print a ledger's entries (not verified)",
}
"""The subcommands and their help."""


def build_parser() -> argparse.ArgumentParser:
    parser, commands = command_parser("python -m swarm.ledger", __doc__, _COMMANDS)
    verify, receipts, show = commands.values()
    verify.add_argument("paths", nargs="+", metavar="PATH_OR_DIR", help="ledger files, or folders holding them")
    receipts.add_argument("--run", required=True, help="run name")
    receipts.add_argument(
        "--dir",
        type=Path,
        default=DEFAULT_LEDGER_DIR,
        help=f"folder holding the ledgers (default {DEFAULT_LEDGER_DIR})",
    )
    show.add_argument("path", type=Path, metavar="PATH", help="a ledger file")
    show.add_argument("--kind", default=None, help="only entries of this kind")
    show.add_argument("--last", type=_positive_int, default=None, metavar="N", help="only the last N entries")
    for cmd in (verify, receipts, show):
        cmd.add_argument("--json", action="store_true", help="print JSON for scripts instead of tables")
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    commands = {"verify": cmd_verify, "receipts": cmd_receipts, "show": cmd_show}
    with _quiet_receipt_warnings():
        try:
            return commands[args.command](args, Console(highlight=False))
        except _BadInput as e:
            Console(stderr=True, highlight=False).print(Text.assemble(("error: ", "bold red"), str(e)))
            return 2


@contextlib.contextmanager
def _quiet_receipt_warnings() -> Iterator[None]:
    """Rejected receipts are summarised in the output; one warning each would bury it."""
    log = logging.getLogger("swarm.ledger")
    previous = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(previous)


# ---------------------------------------------------------------------------------------------- verify


def cmd_verify(args: argparse.Namespace, console: Console) -> int:
    """Verify each ledger and cross-check receipts; 0 when all is well, 1 otherwise."""
    paths = _ledger_paths(args.paths)
    verdicts = [verify_ledger(path) for path in paths]
    rejected: Counter[str] = Counter()
    problems = cross_check(zip(verdicts, (_entries_or_none(path) for path in paths)), counter=rejected)
    ok = all(v.ok for v in verdicts) and not problems
    if args.json:
        print(
            json.dumps(
                {
                    "ok": ok,
                    "ledgers": [v.to_dict() for v in verdicts],
                    "cross_check": problems,
                    "rejected_receipts": dict(rejected),
                },
                indent=2,
            )
        )
    else:
        _print_verdicts(console, verdicts, problems, rejected)
    return 0 if ok else 1


def _ledger_paths(arguments: list[str]) -> list[Path]:
    """Files as given (verify says if one is not a ledger) and the ledgers under folders, each once."""
    found: dict[Path, None] = {}
    for argument in arguments:
        path = Path(argument).expanduser()
        if path.is_dir():
            ledgers = find_ledgers(path)
            if not ledgers:
                raise _BadInput(f"no ledger (*.sqlite) under {path}")
            found.update(dict.fromkeys(ledgers))
        elif path.is_file():
            found[path] = None
        else:
            raise _BadInput(f"{path}: no such file or folder")
    return list(found)


def _entries_or_none(path: Path) -> list[LedgerEntry]:
    try:
        return read_entries(path)
    except LedgerError:
        return []  # verify_ledger already reports why


def _print_verdicts(
    console: Console, verdicts: list[LedgerVerdict], problems: list[str], rejected: Counter[str]
) -> None:
    table = Table(title="ledgers")
    for column in ("ledger", "peer", "run", "entries", "head", "status"):
        table.add_column(column, overflow="fold", no_wrap=column in ("peer", "head"))
    for v in verdicts:
        status = Text("ok", style="green") if v.ok else Text(_plain(v.problems[0]), style="red")
        head = f"{v.head[0]}:{_plain(v.head[1], limit=12)}" if v.num_entries else "-"
        table.add_row(
            Text(str(v.path)),
            Text(_short_peer(v.peer)),
            Text(_plain(v.run, limit=32)),
            str(v.num_entries),
            head,
            status,
        )
    console.print(table)
    for problem in problems:
        console.print(Text.assemble(("cross-check failed: ", "bold red"), _plain(problem, limit=1000)))
    if rejected:
        console.print(f"receipts refused while cross-checking: {_reasons(rejected)}")
    failed = sum(not v.ok for v in verdicts)
    summary = f"{len(verdicts)} ledger(s), {failed} failed verification, {len(problems)} cross-check problem(s)"
    console.print(Text(summary, style="bold red" if failed or problems else "bold green"))


# ---------------------------------------------------------------------------------------------- receipts


def cmd_receipts(args: argparse.Namespace, console: Console) -> int:
    """Per-peer contributions of one run from the receipts in its ledgers under ``--dir``."""
    root = args.dir.expanduser()
    if not root.is_dir():
        raise _BadInput(f"{root} is not a folder of ledgers (set --dir)")
    verdicts = [v for v in map(verify_ledger, find_ledgers(root)) if v.run == args.run]
    if not verdicts:
        raise _BadInput(f"no ledger of run {args.run!r} under {root}")
    rejected: Counter[str] = Counter()
    receipts, witnessed = _gather_receipts(verdicts, run=args.run, rejected=rejected)
    totals = contributions(receipts)
    unverified = [str(v.path) for v in verdicts if not v.ok]
    if args.json:
        rows = [{**c.to_dict(), "witnessed": witnessed[peer]} for peer, c in totals.items()]
        print(
            json.dumps(
                {
                    "run": args.run,
                    "dir": str(root),
                    "num_ledgers": len(verdicts),
                    "unverified_ledgers": unverified,
                    "peers": rows,
                    "rejected": dict(rejected),
                },
                indent=2,
            )
        )
    else:
        _print_contributions(console, args.run, totals, witnessed, rejected, unverified)
    return 0


def _gather_receipts(
    verdicts: list[LedgerVerdict], *, run: str, rejected: Counter[str]
) -> tuple[list[SignedReceipt], Counter[str]]:
    """Every verified receipt in the ledgers, and per peer how many of its distinct receipts another
    member's verified ledger holds (its claim is witnessed, not only its own word)."""
    receipts: list[SignedReceipt] = []
    witnessed_keys: set[tuple[str, str, int, str]] = set()
    for verdict in verdicts:
        for signed in verified_receipts(_entries_or_none(verdict.path), run=run, counter=rejected):
            receipts.append(signed)
            if verdict.ok and verdict.peer != signed.receipt.peer and verdict.peer in signed.receipt.members:
                witnessed_keys.add(receipt_key(signed.receipt))
    return receipts, Counter(key[0] for key in witnessed_keys)


def _print_contributions(
    console: Console,
    run: str,
    totals: dict[str, Contribution],
    witnessed: Counter[str],
    rejected: Counter[str],
    unverified: list[str],
) -> None:
    table = Table(title=f"contributions to run {_plain(run, limit=64)} (verified receipts)")
    for column in ("peer", "rounds", "receipts", "witnessed", "samples", "sent", "received"):
        table.add_column(column, justify="left" if column == "peer" else "right", overflow="fold")
    for peer, c in totals.items():
        table.add_row(
            Text(peer),
            str(c.rounds),
            str(c.num_receipts),
            str(witnessed[peer]),
            f"{c.samples:,}",
            _human_bytes(c.bytes_sent),
            _human_bytes(c.bytes_received),
        )
    console.print(table)
    console.print("witnessed: receipts also held by another member's verified ledger")
    console.print(f"rejected receipts: {_reasons(rejected) if rejected else 'none'}")
    if unverified:
        console.print(
            Text(
                f"{len(unverified)} ledger(s) failed verification and witness nothing; "
                f"run `python -m swarm.ledger verify` on them",
                style="bold red",
            )
        )


# ---------------------------------------------------------------------------------------------- show


def cmd_show(args: argparse.Namespace, console: Console) -> int:
    """Print a ledger's entries, optionally of one kind and only the last N."""
    path = args.path.expanduser()
    if not path.is_file():
        raise _BadInput(f"{path}: no such ledger file")
    try:
        entries = read_entries(path)
    except LedgerError as e:
        raise _BadInput(str(e)) from None
    if args.kind is not None:
        entries = [e for e in entries if e.kind == args.kind]
    if args.last is not None:
        entries = entries[-args.last :]
    if args.json:
        print(json.dumps([e.to_dict() for e in entries], indent=2))
        return 0
    table = Table(title=f"{path} (not verified here: use `verify`)")
    for column in ("seq", "time (UTC)", "kind", "body"):
        table.add_column(column)
    for e in entries:
        body = json.dumps(e.body, sort_keys=True, separators=(",", ":"))
        table.add_row(str(e.seq), _utc(e.t), Text(e.kind), Text(_plain(body)))
    console.print(table)
    return 0


# ---------------------------------------------------------------------------------------------- text


def _plain(text: str, *, limit: int = _MAX_CELL_CHARS) -> str:
    """Untrusted text made safe for a terminal (escapes shown, not obeyed) and cut to ``limit`` chars."""
    text = text if text.isprintable() else repr(text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _short_peer(peer: str) -> str:
    return _plain(peer) if len(peer) <= 12 else "…" + _plain(peer[-8:])


def _reasons(counter: Counter[str]) -> str:
    return ", ".join(f"{reason}: {count}" for reason, count in counter.most_common())


def _human_bytes(num_bytes: int) -> str:
    value, unit = float(num_bytes), "B"
    for larger in ("KB", "MB", "GB", "TB"):
        if value < 1000:
            break
        value, unit = value / 1000, larger
    return f"{num_bytes} B" if unit == "B" else f"{value:,.1f} {unit}"


def _utc(t: float) -> str:
    try:
        return datetime.datetime.fromtimestamp(t, tz=datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
    except (OverflowError, OSError, ValueError):
        return str(t)


if __name__ == "__main__":
    sys.exit(main())
