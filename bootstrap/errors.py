"""Swarm's one exception taxonomy. Every error Swarm raises on purpose is a `SwarmError`:

* `Rejected` (also a ValueError): untrusted input refused - a record, status entry, receipt,
  manifest, shard or stream message. ``reason`` is a short fixed label (the counter key),
  ``detail`` says more; each kind names itself in ``what``. `bootstrap.framing.ProtocolError` is
  the stream protocols' one.
* `ConfigError` (also a ValueError): a setting or argument the user gave is wrong; the message names
  the field (e.g. `swarm.config.RunMismatch`, `swarm.tasks.UnknownTaskError`).
* `StartError` (also a RuntimeError): a component could not start (the DHT, a metrics endpoint).
* `NetworkError` (also a RuntimeError): a peer could not be reached or broke a protocol while this
  peer asked it something (`peers.bandwidth.ProbeError`, `swarm.checkpoint.exchange.FetchError`);
  ``reason`` is a short label.
* `StateError` (also a RuntimeError): a file or object is in a state that forbids the call (an
  identity key in use, a corrupt ledger, a closed component).

The builtin bases stay, so ``except ValueError`` around a parser still works.
"""

from __future__ import annotations


class SwarmError(Exception):
    """Base of every error Swarm raises on purpose."""


class Rejected(SwarmError, ValueError):
    """Untrusted input was refused; ``reason`` is a short fixed label (a counter key), ``detail`` says more.

    Subclasses set ``what`` ("manifest", "receipt", ...): the message reads "WHAT rejected: REASON
    (DETAIL)"; with no ``what`` it reads "REASON: DETAIL"."""

    what = ""

    def __init__(self, reason: str, detail: str = ""):
        self.reason = reason
        self.detail = detail
        if self.what:
            super().__init__(f"{self.what} rejected: {reason}" + (f" ({detail})" if detail else ""))
        else:
            super().__init__(f"{reason}: {detail}" if detail else reason)


class ConfigError(SwarmError, ValueError):
    """A setting or argument is wrong; the message names it and what would be right."""


class StartError(SwarmError, RuntimeError):
    """A component could not start; the message names the address or file at fault and what to do."""


class NetworkError(SwarmError, RuntimeError):
    """A peer could not be reached, or broke a protocol, while this peer asked it something."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class StateError(SwarmError, RuntimeError):
    """A file or object is in a state that forbids the call."""


def one_line(error: object) -> str:
    """``error`` as one line for a log or a counter's detail (an exception with no message: its type's name)."""
    text = " ".join(str(error).split())
    return text or (type(error).__name__ if isinstance(error, BaseException) else "")
