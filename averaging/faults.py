"""Fault injection for averaging rounds, keyed by (peer, round, phase), counting what it fired.

A test builds one injector, plans faults, and attaches it to every averager; afterwards it asserts
both the round's outcome and ``injector.fired`` (a fault that silently did nothing proves nothing).
Actions: ``crash`` (the peer vanishes: its streams close and its step is abandoned), ``stall``
(it stops talking for ``stall_s``, still answering probes: a straggler), ``freeze`` (its event loop is
held for ``stall_s`` or until ``thaw`` is set: nothing of it answers, as a SIGSTOPped or cut-off peer's),
and ``kill`` (SIGKILL of the whole process, for subprocess peers).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from bootstrap.errors import SwarmError


class Crashed(SwarmError):
    """Raised inside a crashed peer's step; the peer is gone from the others' point of view."""


PHASES = ("matchmaking", "joined", "grouped", "send", "piece", "agree", "reduce")
ACTIONS = ("crash", "stall", "freeze", "kill")


@dataclass
class FaultInjector:
    stall_s: float = 60.0
    plan: dict[tuple[str, int, str], str] = field(default_factory=dict)
    """(peer name, round, phase) -> action; phase is matchmaking, joined (a follower, after its join went out),
    grouped (a follower, after its leader answered with the group, before it looks at it),
    send, piece (before each piece of a part but the first), agree (before a reducer sends its list of senders)
    or reduce (after the agreement)."""
    fired: Counter = field(default_factory=Counter)
    """(peer name, round, phase, action) -> times fired."""
    max_fires: dict[tuple[str, int, str], int] = field(default_factory=dict)
    thaw: threading.Event = field(default_factory=threading.Event)
    """Ends every ``freeze`` at once."""

    def add(self, peer: str, round_: int, phase: str, action: str, *, times: int = 1) -> None:
        if phase not in PHASES or action not in ACTIONS:
            raise ValueError(f"unknown phase/action {phase!r}/{action!r}")
        self.plan[(peer, round_, phase)] = action
        self.max_fires[(peer, round_, phase)] = times

    def attach(self, averager: Any, name: str) -> None:
        async def hook(round_: int, phase: str, _peer: str) -> None:
            key = (name, round_, phase)
            action = self.plan.get(key)
            if action is None or self.max_fires.get(key, 0) <= 0:
                return
            self.max_fires[key] -= 1
            self.fired[(name, round_, phase, action)] += 1
            if action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif action == "stall":
                await asyncio.sleep(self.stall_s)
            elif action == "freeze":
                self.thaw.wait(self.stall_s)  # holds the event loop: no stream of this peer moves
            else:
                await averager.crash()
                raise Crashed(f"{name} crashed in round {round_} during {phase}")

        averager.fault_hook = hook
