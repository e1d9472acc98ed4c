"""PNG figures for :mod:`swarm.report`, drawn with matplotlib's Agg canvas (no display, no pyplot state).

Callers pass plain series; every label is reduced to a safe character set here, because labels come
from ledgers (untrusted) and matplotlib would interpret ``$...$`` in them as mathtext.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

# printable ASCII without "$" (mathtext) and "\\" (TeX commands inside it)
_UNSAFE_LABEL_CHARS = re.compile(r"[^\x20-\x7e]|[$\\]")
_MAX_LABEL_CHARS = 48
_FIGSIZE_IN = (9.0, 4.8)
_DPI = 110
_PALETTE = (
    "tab:blue",
    "tab:orange",
    "tab:green",
    "tab:red",
    "tab:purple",
    "tab:brown",
    "tab:pink",
    "tab:gray",
    "tab:olive",
    "tab:cyan",
)
_MAX_LEGEND_ENTRIES = 20


@dataclass(frozen=True, kw_only=True, slots=True)
class Series:
    """One peer's points on a figure."""

    label: str | None
    """Legend text (sanitised before drawing); None keeps the series out of the legend."""
    color_index: int
    """Index into a fixed palette, so a peer keeps its colour across figures."""
    points: tuple[tuple[float, float], ...]
    """(x, y) pairs, already sorted by x."""
    linestyle: str = "-"
    """matplotlib line style; "" draws markers only."""
    marker: str = "."
    """matplotlib marker; "" draws a line only."""
    drawstyle: str = "default"
    """matplotlib draw style ("steps-post" for cumulative counters)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Axes:
    """Titles of one figure and the note shown when it has no points."""

    title: str
    """Figure title."""
    xlabel: str
    """x-axis label."""
    ylabel: str
    """y-axis label."""
    empty_note: str
    """Drawn in the middle of the figure when no series has a point."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Lane:
    """One peer's row on the failure and recovery timeline."""

    label: str
    """Lane label (sanitised before drawing)."""
    color_index: int
    """Palette index of the peer."""
    span: tuple[float, float] | None
    """(first, last) entry time in seconds since the run's start; None for an empty ledger."""
    markers: tuple[tuple[float, str], ...]
    """(time in seconds, event kind) pairs; kinds not in TIMELINE_STYLES are drawn as a dot."""


TIMELINE_STYLES: dict[str, tuple[str, str]] = {
    "start": ("o", "tab:green"),
    "joined": ("^", "tab:blue"),
    "state_synced": ("s", "tab:cyan"),
    "failure": ("X", "tab:red"),
    "peer_replaced": ("P", "tab:purple"),
    "checkpoint_sealed": ("*", "goldenrod"),
    "record_rejected": ("v", "tab:orange"),
    "stop": ("o", "black"),
    "vanished (killed?)": ("x", "darkred"),
}
"""Marker and colour of each timeline event kind, in legend order."""


def safe_label(text: str) -> str:
    """``text`` limited to a plain character set and a bounded length (safe for matplotlib)."""
    cleaned = _UNSAFE_LABEL_CHARS.sub("?", str(text))
    return cleaned if len(cleaned) <= _MAX_LABEL_CHARS else cleaned[: _MAX_LABEL_CHARS - 1] + "~"


def color(index: int) -> str:
    return _PALETTE[index % len(_PALETTE)]


def _new_figure(axes: Axes) -> tuple[Figure, object]:
    fig = Figure(figsize=_FIGSIZE_IN, dpi=_DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set(title=safe_label_long(axes.title), xlabel=axes.xlabel, ylabel=axes.ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def safe_label_long(text: str) -> str:
    """Like :func:`safe_label` but allows a longer text (figure titles)."""
    return _UNSAFE_LABEL_CHARS.sub("?", str(text))[:120]


def _note_empty(ax, note: str) -> None:
    ax.text(
        0.5, 0.5, safe_label_long(note), ha="center", va="center", transform=ax.transAxes, fontsize=11, color="gray"
    )
    ax.set_xticks([])
    ax.set_yticks([])


def _save(fig: Figure, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, format="png")


def _legend(ax) -> None:
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles[:_MAX_LEGEND_ENTRIES], labels[:_MAX_LEGEND_ENTRIES], fontsize=7, loc="best")


def series_plot(path: Path, *, axes: Axes, series: list[Series]) -> None:
    """Draw ``series`` on one set of axes and save a PNG at ``path``; notes "no data" when all are empty."""
    fig, ax = _new_figure(axes)
    drawn = [s for s in series if s.points]
    for s in drawn:
        xs, ys = zip(*s.points)
        ax.plot(
            xs,
            ys,
            linestyle=s.linestyle or "none",
            marker=s.marker or None,
            drawstyle=s.drawstyle,
            color=color(s.color_index),
            label=safe_label(s.label) if s.label else None,
            markersize=5,
        )
    if drawn:
        _legend(ax)
    else:
        _note_empty(ax, axes.empty_note)
    _save(fig, path)


def timeline_plot(path: Path, *, axes: Axes, lanes: list[Lane]) -> None:
    """One horizontal lane per peer with a marker per event; saves a PNG at ``path``."""
    fig, ax = _new_figure(axes)
    if not any(lane.span for lane in lanes):
        _note_empty(ax, axes.empty_note)
        _save(fig, path)
        return
    for y, lane in enumerate(lanes):
        if lane.span is not None:
            ax.hlines(y, *lane.span, color=color(lane.color_index), linewidth=2, alpha=0.4)
    seen: set[str] = set()
    for y, lane in enumerate(lanes):
        for t_s, kind in lane.markers:
            marker, tint = TIMELINE_STYLES.get(kind, (".", "gray"))
            label = kind if kind in TIMELINE_STYLES and kind not in seen else None
            seen.add(kind)
            ax.plot([t_s], [y], linestyle="none", marker=marker, color=tint, markersize=9, label=label)
    ax.set_yticks(range(len(lanes)), [safe_label(lane.label) for lane in lanes], fontsize=8)
    ax.set_ylim(-0.7, len(lanes) - 0.3)
    ax.invert_yaxis()
    _ordered_legend(ax)
    _save(fig, path)


def _ordered_legend(ax) -> None:
    handles, labels = ax.get_legend_handles_labels()
    order = {kind: i for i, kind in enumerate(TIMELINE_STYLES)}
    pairs = sorted(zip(handles, labels), key=lambda pair: order.get(pair[1], len(order)))
    if pairs:
        ax.legend(
            [h for h, _ in pairs],
            [label for _, label in pairs],
            fontsize=7,
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
            borderaxespad=0.0,
        )
