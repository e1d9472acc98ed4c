"""Rich rendering of a status-board snapshot (:func:`swarm.status.snapshot`): pure, no I/O.

Every string that came from the network is wrapped in :class:`rich.text.Text`, so a peer cannot
inject console markup (``[bold red]...``) into the dashboard.
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text


def _short(peer: str) -> Text:
    return Text(peer[-12:] if peer else "swarm")


def _num(value: float | int | None, fmt: str = "{:.3f}") -> str:
    return "-" if value is None else fmt.format(value)


def _bytes(num_bytes: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= size:
            return f"{num_bytes / size:.1f} {unit}"
    return f"{num_bytes} B"


def _device(device: dict[str, Any] | None) -> Text:
    if device is None:
        return Text("-")
    count = f" x{device['count']}" if device["count"] > 1 else ""
    return Text(
        f"{device['accelerator']}: {device['name'][:28]}{count}, {device['memory_total_bytes'] / 2**30:.0f} GiB"
    )


def _age(age_s: float | None, *, missed: bool = False) -> Text:
    if age_s is None:
        return Text("-")
    return Text(f"{age_s:.0f}s", style="bold red" if missed else "")


def peers_table(board: dict[str, Any]) -> Table:
    table = Table(title=f"peers ({len(board['peers'])})", expand=True)
    for column in (
        "peer",
        "state",
        "round",
        "step",
        "samples/s",
        "loss",
        "val loss",
        "device",
        "region",
        "record age",
        "status age",
        "work checks",
    ):
        table.add_column(
            column, justify="right" if column in ("round", "step", "samples/s", "loss", "val loss") else "left"
        )
    for p in board["peers"]:
        table.add_row(
            _short(p["peer"]),
            Text(p["state"]),
            _num(p["round"], "{}"),
            _num(p["step"], "{}"),
            _num(p["samples_per_s"], "{:.1f}"),
            _num(p["loss"]),
            _num(p["val_loss"]),
            _device(p["device"]),
            Text(p["region"] or "-"),
            _age(p["record_age_s"]),
            _age(p["status_age_s"], missed=p["heartbeat_missed"]),
            _work(p.get("work")),
        )
    return table


def _work(work: dict[str, Any] | None) -> Text:
    """Verified-work checks: passed/done, failures, refusals, and how many peers this one excluded."""
    if work is None:
        return Text("-")
    text = f"{work['passed']}/{work['checks']} ok"
    if work["failed"] or work["refused"]:
        text += f", {work['failed']} failed, {work['refused']} refused"
    if work["excluded"]:
        text += f", excluded {len(work['excluded'])}: " + ", ".join(p[-8:] for p in work["excluded"][:4])
    return Text(text, style="bold red" if work["failed"] else "")


def groups_table(board: dict[str, Any]) -> Table:
    table = Table(title="last-round groups", expand=True)
    for column in ("group", "round", "members", "outcome", "duration", "sent", "received", "reported by"):
        table.add_column(column)
    for g in board["groups"]:
        members = ", ".join(m[-8:] for m in g["members"][:8]) + (" ..." if len(g["members"]) > 8 else "")
        table.add_row(
            Text(g["group_id"][:12]),
            str(g["round"]),
            Text(f"{len(g['members'])}: {members}"),
            Text(g["outcome"]),
            f"{g['duration_s']:.1f}s",
            _bytes(g["bytes_sent"]),
            _bytes(g["bytes_received"]),
            str(len(g["reported_by"])),
        )
    return table


def progress_panel(board: dict[str, Any]) -> Panel:
    p = board["progress"]
    grid = Table.grid(padding=(0, 2))
    for label, value in (
        ("round", _num(p["round"], "{}")),
        ("step", _num(p["step"], "{}")),
        ("loss", _num(p["loss"])),
        ("val loss", _num(p["val_loss"])),
        ("samples/s (total)", f"{p['samples_per_s']:.1f}"),
        ("peers", str(p["num_peers"])),
    ):
        grid.add_row(Text(label, style="bold"), value)
    return Panel(grid, title="progress")


def checkpoint_panel(board: dict[str, Any]) -> Panel:
    c = board["checkpoint"]
    if c is None:
        return Panel(Text("no sealed checkpoint announced yet"), title="last sealed checkpoint")
    grid = Table.grid(padding=(0, 2))
    metrics = ", ".join(f"{k}={v}" for k, v in sorted(c["metrics"].items())) or "-"
    for label, value in (
        ("step", str(c["step"])),
        ("digest", c["digest"][:16]),
        ("signers", f"{len(c['signers'])}/{len(c['participants'])}: " + ", ".join(s[-8:] for s in c["signers"][:6])),
        ("metrics", metrics),
        ("announced by", str(c["announced_by"])),
    ):
        grid.add_row(Text(label, style="bold"), Text(value))
    return Panel(grid, title="last sealed checkpoint")


def events_table(board: dict[str, Any]) -> Table:
    table = Table(title="recent events", expand=True)
    for column in ("time", "peer", "event", "detail"):
        table.add_column(column)
    for e in board["events"]:
        style = "italic" if e["source"] == "observer" else ""
        table.add_row(
            time.strftime("%H:%M:%S", time.localtime(e["t"])),
            _short(e["peer"]),
            Text(e["kind"], style=style),
            Text(e["detail"]),
        )
    return table


def footer(board: dict[str, Any]) -> Text:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(board["t"]))
    text = Text(f"run {board['run']!r} at {stamp}")
    if board["rejected"]:
        text.append(
            "  refused status entries: " + ", ".join(f"{k}={v}" for k, v in sorted(board["rejected"].items())),
            style="yellow",
        )
    for error in board["errors"]:
        text.append(f"\n{error}", style="red")
    return text


def render_board(board: dict[str, Any]) -> RenderableType:
    """The whole dashboard for one snapshot."""
    side = Table.grid(expand=True, padding=(0, 1))
    side.add_column(ratio=1)
    side.add_column(ratio=2)
    side.add_row(progress_panel(board), checkpoint_panel(board))
    return Group(peers_table(board), groups_table(board), side, events_table(board), footer(board))
