"""A tiny append-only JSON-lines event log: what a peer did, for the demo, tests and reports."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any


class EventLog:
    """Append one JSON object per line, flushed at once so a reader (or a SIGKILL) sees whole lines."""

    def __init__(self, path: str | os.PathLike | None):
        self.path = Path(path) if path else None
        self._lock = threading.Lock()
        self._file = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (closed in close())

    def emit(self, event: str, **fields: Any) -> None:
        if self._file is None:
            return
        line = json.dumps({"t": time.time(), "event": event, **fields}, default=str)
        with self._lock:
            self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_events(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read an event log, skipping a torn last line or any line that is not a JSON object."""
    events = []
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return events
    for line in text.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("event"), str):
            events.append(obj)
    return events
