"""The signed, strictly parsed payload that every record Swarm publishes is made of.

Records, status entries, receipts and manifests share one shape: a frozen dataclass whose
canonical JSON (`bootstrap.identity.canonical_json`: sorted keys, ints and strings only) is what
its writer signs. Their parsers share the helpers here, each raising the caller's `Rejected`
subclass (``rejected``) with a short reason:

* `strict_json`: UTF-8 JSON with no duplicate keys, no floats, no NaN, bounded nesting;
* `expect_keys`: an object with exactly the expected keys;
* `unwrap_signed`: a DHT value ``{"p": payload bytes, "s": signature bytes}`` within a size bound;
* `from_dict`: a (nested) frozen dataclass from untrusted JSON, exact fields and types;
  `as_dict` is its inverse (the JSON-ready fields that get signed), `JsonFields.to_dict` the method,
  and `Signable.payload` / `Signable.digest` the canonical bytes a writer signs and their SHA-256;
* `check_int` / `check_str` / `check_hex`: field checks for ``__post_init__`` (ValueError);
* `RejectionLog`: counts each refusal in a counter the caller passes in, logs it once per
  (reason, source).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import re
import types
import typing
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from bootstrap.errors import Rejected
from bootstrap.identity import Identity, canonical_json

logger = logging.getLogger(__name__)

INT64_MAX = (1 << 63) - 1
_HEX = {64: re.compile(r"[0-9a-f]{64}"), 128: re.compile(r"[0-9a-f]{128}")}
_MAX_LOGGED = 10_000


def strict_json(data: bytes, rejected: type[Rejected]) -> Any:
    """``data`` parsed as JSON of ints, strings, lists and objects only (no duplicate keys)."""

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result = dict(pairs)
        if len(result) != len(pairs):
            raise rejected("malformed", "duplicate key in JSON object")
        return result

    def refuse(kind: str) -> Callable[[str], Any]:
        def hook(text: str) -> Any:
            raise rejected("malformed", f"{kind} {text!r:.40} not allowed (ints and strings only)")

        return hook

    try:
        return json.loads(
            data.decode("utf-8"),
            object_pairs_hook=no_duplicates,
            parse_float=refuse("float"),
            parse_constant=refuse("constant"),
        )
    except UnicodeDecodeError:
        raise rejected("malformed", "not UTF-8") from None
    except Rejected:
        raise
    except (ValueError, RecursionError) as e:  # JSONDecodeError, or an int longer than Python parses
        raise rejected("malformed", f"not JSON: {str(e)[:200]}") from None


def expect_keys(obj: Any, keys: set[str], where: str, rejected: type[Rejected]) -> None:
    """``obj`` must be an object with exactly ``keys``."""
    if not isinstance(obj, dict):
        raise rejected("malformed", f"{where}: expected an object, got {type(obj).__name__}")
    if set(obj) != keys:
        extra, missing = sorted(map(str, set(obj) - keys)), sorted(keys - set(obj))
        raise rejected("malformed", f"{where}: unexpected fields {extra!r:.200}, missing {missing!r}")


def unwrap_signed(value: Any, *, max_bytes: int, rejected: type[Rejected]) -> tuple[bytes, bytes]:
    """(payload, signature) of a DHT value ``{"p": bytes, "s": bytes}`` of at most ``max_bytes`` in all."""
    if not isinstance(value, dict) or set(value) != {"p", "s"}:
        raise rejected("malformed", "value is not {p, s}")
    payload, signature = value["p"], value["s"]
    if not isinstance(payload, bytes) or not isinstance(signature, bytes):
        raise rejected("malformed", "payload or signature is not bytes")
    if len(payload) + len(signature) > max_bytes:
        raise rejected("oversized", f"{len(payload) + len(signature)} bytes > {max_bytes}")
    return payload, signature


def from_dict(cls: type, data: Any, path: str, *, max_str: int = 512, max_items: int = 16) -> Any:
    """A frozen dataclass from untrusted JSON, requiring exactly its fields and their types (TypeError)."""
    if not isinstance(data, dict):
        raise TypeError(f"{path}: expected an object")
    hints = _field_types(cls)
    if data.keys() != hints.keys():
        raise TypeError(f"{path}: fields {sorted(set(data) ^ set(hints))} missing or unexpected")
    return cls(**{name: _coerce(tp, data[name], f"{path}.{name}", max_str, max_items) for name, tp in hints.items()})


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """A dataclass's field names and resolved types, in field order (resolving them compiles every string
    annotation: 0.4 of the 0.7 ms that parsing a capability record took before this cache)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def as_dict(obj: Any) -> dict[str, Any]:
    """A dataclass's fields as JSON-ready data, the inverse of `from_dict`.

    Nested dataclasses become objects, tuples and lists become lists, mappings plain dicts.
    """
    return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}


class JsonFields:
    """Mixin of a dataclass whose ``to_dict()`` is `as_dict`: its fields as JSON-ready data."""

    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        return as_dict(self)


class Signable(JsonFields):
    """Mixin of a record its writer signs: ``payload()`` is what is signed, ``digest()`` names the record."""

    __slots__ = ()

    def payload(self) -> bytes:
        """Canonical JSON of the fields (`canonical_json`): what is signed."""
        return canonical_json(self.to_dict())

    def digest(self) -> str:
        """SHA-256 hex of `payload`."""
        return hashlib.sha256(self.payload()).hexdigest()

    def signature_by(self, identity: Identity, *, signer: str, kind: str, run: str) -> str:
        """Hex Ed25519 signature of `payload` (``kind`` and ``run`` bound in) by ``identity``, which must be
        ``signer``, the peer the record names as its writer; else ValueError."""
        if identity.peer_id != signer:
            raise ValueError(
                f"the {type(self).__name__} names {signer} as its signer, not the signing identity {identity.peer_id}"
            )
        return identity.sign(kind=kind, run_id=run, payload=self.payload()).hex()


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return as_dict(value)
    if isinstance(value, (tuple, list)):
        return [_plain(item) for item in value]
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    return value


def _coerce(tp: Any, value: Any, path: str, max_str: int, max_items: int) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(inner, value, path, max_str, max_items)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path, max_str=max_str, max_items=max_items)
    if origin is tuple:
        if not isinstance(value, list) or len(value) > max_items:
            raise TypeError(f"{path}: expected a list of at most {max_items} items")
        return tuple(_coerce(args[0], item, f"{path}[]", max_str, max_items) for item in value)
    if tp is bool:
        if not isinstance(value, bool):
            raise TypeError(f"{path}: expected a boolean")
        return value
    if tp is int:
        if not isinstance(value, int) or isinstance(value, bool) or not -(2**63) <= value < 2**63:
            raise TypeError(f"{path}: expected a 64-bit integer")
        return value
    if tp is str:
        if not isinstance(value, str) or len(value) > max_str:
            raise TypeError(f"{path}: expected a string of at most {max_str} characters")
        return value
    raise TypeError(f"{path}: unsupported type {tp}")


def check_int(name: str, value: Any, *, minimum: int = 0, maximum: int = INT64_MAX) -> None:
    """``value`` must be an int (not a bool) in [minimum, maximum]; else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise ValueError(f"{name} must be an int in [{minimum}, {maximum}], got {value!r:.40}")


def check_str(name: str, value: Any, *, max_chars: int, allow_empty: bool = False, printable: bool = False) -> None:
    """``value`` must be a string of at most ``max_chars`` characters, without NUL (and printable, if asked)."""
    if (
        not isinstance(value, str)
        or len(value) > max_chars
        or (not value and not allow_empty)
        or "\x00" in value
        or (printable and not value.isprintable())
    ):
        kind = "printable " if printable else ""
        raise ValueError(
            f"{name} must be a {'' if allow_empty else 'non-empty '}{kind}string of at most "
            f"{max_chars} chars without NUL, got {value!r:.140}"
        )


def check_hex(name: str, value: Any, *, chars: int = 64) -> None:
    """``value`` must be ``chars`` lowercase hex digits (64: a SHA-256 digest; 128: a signature)."""
    if not isinstance(value, str) or not _HEX[chars].fullmatch(value):
        raise ValueError(f"{name} must be {chars} lowercase hex chars, got {value!r:.80}")


class RejectionLog:
    """Counts refusals by reason in ``counts`` (the owner's counter) and logs each (reason, source) once:
    a warning, or an info line for the ``routine`` reasons (e.g. a record that expired in flight)."""

    def __init__(self, what: str, counts: Counter[str] | None = None, *, routine: frozenset[str] = frozenset()):
        self.what, self.routine = what, routine
        self.counts: Counter[str] = Counter() if counts is None else counts
        self._logged: set[tuple[str, str]] = set()

    def reject(self, error: Rejected, *, source: Any = "", where: str = "") -> None:
        self.counts[error.reason] += 1
        key = (error.reason, str(source)[:60])
        if key not in self._logged and len(self._logged) < _MAX_LOGGED:
            self._logged.add(key)
            level = logging.INFO if error.reason in self.routine else logging.WARNING
            prefix = f"{where}: " if where else ""
            source_text = f" for {key[1]!r}" if key[1] else ""
            logger.log(level, "%srefused a %s%s: %s", prefix, self.what, source_text, error)
