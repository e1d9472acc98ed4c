"""Peer identity: a persistent Ed25519 signing key and domain-separated signatures.

Every object Swarm signs (peer bindings now; capability records, manifests and receipts later)
goes through :func:`signed_bytes`, which names the object *kind* and the *run id* inside the signed
bytes. A signature made for one kind or run therefore never verifies for another.

The key lives at ``~/.swarm/identity.key`` (or a path of the user's choice), created with mode 0600.
A key file that other users can read is refused rather than used: it may already be compromised.

The same key is the peer's libp2p identity: its peer ID ("12D3KooW...") is derived from the Ed25519
public key, so anyone can check that a public key speaks for a peer ID without trusting a third
party (:func:`peer_id_from_public_key`), and the key can never be claimed by another peer ID.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import base58
from nacl.exceptions import BadSignatureError
from nacl.signing import SigningKey, VerifyKey

from bootstrap.errors import StateError

DEFAULT_IDENTITY_PATH = Path("~/.swarm/identity.key")
_KEY_FILE_MAGIC = b"swarm-ed25519-v1\n"
_SEED_SIZE_BYTES = 32
_DOMAIN_PREFIX = b"swarm/v1"
BINDING_KIND = "swarm/binding"


class IdentityError(StateError):
    """The identity key file is missing, unsafe, unreadable, corrupt or already in use."""


# libp2p's protobuf framing of an Ed25519 key: field 1 (KeyType) = 1 (Ed25519), field 2 = bytes
_LIBP2P_ED25519_PUBLIC_PREFIX = b"\x08\x01\x12\x20"
_LIBP2P_ED25519_PEER_ID_PREFIX = b"\x00\x24\x08\x01\x12\x20"
_MAX_PEER_ID_CHARS = 128
_LIBP2P_ED25519_PRIVATE_PREFIX = b"\x08\x01\x12\x40"


_CONVERSIONS_CACHED = 4096
"""Peer ID <-> key conversions kept (base58 in pure Python: every signature check and seal converts)."""


def peer_id_from_public_key(public_key: bytes) -> str:
    """The libp2p peer ID (base58) of an Ed25519 public key: an identity multihash of the framed key."""
    if not isinstance(public_key, bytes) or len(public_key) != 32:
        raise ValueError("an Ed25519 public key is 32 bytes")
    return _peer_id_of(public_key)


@functools.lru_cache(maxsize=_CONVERSIONS_CACHED)
def _peer_id_of(public_key: bytes) -> str:
    framed = _LIBP2P_ED25519_PUBLIC_PREFIX + public_key
    return base58.b58encode(b"\x00" + bytes([len(framed)]) + framed).decode()


def public_key_from_peer_id(peer_id: str) -> bytes:
    """The Ed25519 public key inside a libp2p Ed25519 peer ID ("12D3KooW..."); ValueError otherwise.

    Such peer IDs are an identity multihash of the protobuf-framed key, so the key is recoverable.
    """
    if not isinstance(peer_id, str) or not 0 < len(peer_id) <= _MAX_PEER_ID_CHARS:
        raise ValueError(f"not an Ed25519 peer ID: {peer_id!r:.140}")
    return _public_key_of(peer_id)


@functools.lru_cache(maxsize=_CONVERSIONS_CACHED)  # a refusal (ValueError) is not cached
def _public_key_of(peer_id: str) -> bytes:
    try:
        raw = base58.b58decode(peer_id)
    except ValueError:
        raise ValueError(f"not an Ed25519 peer ID (bad base58): {peer_id!r}") from None
    if len(raw) != len(_LIBP2P_ED25519_PEER_ID_PREFIX) + 32 or not raw.startswith(_LIBP2P_ED25519_PEER_ID_PREFIX):
        raise ValueError(f"not an Ed25519 peer ID (wrong multihash framing): {peer_id!r}")
    public_key = raw[len(_LIBP2P_ED25519_PEER_ID_PREFIX) :]
    if peer_id_from_public_key(public_key) != peer_id:
        raise ValueError(f"not an Ed25519 peer ID (non-canonical encoding): {peer_id!r}")
    return public_key


def canonical_json(obj: Any) -> bytes:
    """Deterministic JSON bytes (sorted keys, no whitespace, UTF-8); floats are refused.

    Floats can print differently across platforms, so signed payloads carry ints and strings only.
    """
    _reject_floats(obj)
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _reject_floats(obj: Any) -> None:
    if isinstance(obj, float):
        raise TypeError(f"floats are not allowed in signed payloads: {obj!r}")
    if isinstance(obj, dict):
        for key, value in obj.items():
            if not isinstance(key, str):
                raise TypeError(f"signed payload keys must be strings, got {key!r}")
            _reject_floats(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _reject_floats(value)


def signed_bytes(*, kind: str, run_id: str, payload: bytes) -> bytes:
    """The exact bytes that are signed for an object of ``kind`` in run ``run_id``."""
    for name, value in (("kind", kind), ("run_id", run_id)):
        if not isinstance(value, str) or "\x00" in value:
            raise ValueError(f"{name} must be a string without NUL bytes, got {value!r}")
    return b"\x00".join([_DOMAIN_PREFIX, kind.encode(), run_id.encode(), payload])


def verify(*, public_key: bytes, kind: str, run_id: str, payload: bytes, signature: bytes) -> bool:
    """True when ``signature`` is ``public_key``'s signature of ``payload`` for this kind and run.

    Never raises on malformed input: a wrong-size key or signature simply does not verify.
    """
    if not isinstance(public_key, bytes) or len(public_key) != 32:
        return False
    if not isinstance(signature, bytes) or len(signature) != 64:
        return False
    try:
        message = signed_bytes(kind=kind, run_id=run_id, payload=payload)
        VerifyKey(public_key).verify(message, signature)
    except (BadSignatureError, ValueError, TypeError):
        return False
    return True


@dataclass(frozen=True, kw_only=True, slots=True)
class PeerBinding:
    """A statement, signed by an Ed25519 key, that it speaks for one libp2p peer ID.

    libp2p authenticates the peer ID of every connection, so a binding received over a connection
    from that same peer ID ties the Ed25519 key to the network identity.
    """

    peer_id: str
    """The libp2p peer ID (base58) this key speaks for."""
    public_key: bytes
    """The Ed25519 public key (32 bytes)."""
    signature: bytes
    """Signature over the canonical payload, kind ``swarm/binding``, run id empty."""

    def payload(self) -> bytes:
        return canonical_json({"peer_id": self.peer_id, "public_key": self.public_key.hex()})

    def is_valid(self) -> bool:
        """The signature verifies and the peer ID is the one derived from the public key."""
        try:
            if self.peer_id != peer_id_from_public_key(self.public_key):
                return False
        except ValueError:
            return False
        return verify(
            public_key=self.public_key, kind=BINDING_KIND, run_id="", payload=self.payload(), signature=self.signature
        )

    def to_dict(self) -> dict[str, str]:
        return {"peer_id": self.peer_id, "public_key": self.public_key.hex(), "signature": self.signature.hex()}

    @classmethod
    def from_dict(cls, data: Any) -> PeerBinding:
        """Parse untrusted input; raises ValueError on anything malformed (does not check the signature)."""
        if not isinstance(data, dict) or set(data) != {"peer_id", "public_key", "signature"}:
            raise ValueError(f"malformed binding: expected keys peer_id, public_key, signature; got {data!r:.200}")
        try:
            public_key, signature = bytes.fromhex(data["public_key"]), bytes.fromhex(data["signature"])
        except (TypeError, ValueError) as e:
            raise ValueError(f"malformed binding: bad hex ({e})") from None
        if not isinstance(data["peer_id"], str) or len(data["peer_id"]) > 128:
            raise ValueError("malformed binding: peer_id must be a short string")
        return cls(peer_id=data["peer_id"], public_key=public_key, signature=signature)


class Identity:
    """An Ed25519 signing key with domain-separated sign/verify helpers."""

    def __init__(self, signing_key: SigningKey, *, path: Path | None = None):
        self._signing_key = signing_key
        self.path = path
        self._lock_fd: int | None = None

    @property
    def peer_id(self) -> str:
        """The libp2p peer ID this key is (see module docstring)."""
        return peer_id_from_public_key(self.public_key)

    @contextlib.contextmanager
    def libp2p_identity_file(self) -> Iterator[str]:
        """A private (0600, in a 0700 temp dir) libp2p key file for p2pd, removed on exit.

        p2pd reads it once at start-up, so the file need not outlive the DHT's start.
        """
        folder = tempfile.mkdtemp(prefix="swarm-id-")
        path = os.path.join(folder, "libp2p.key")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(_LIBP2P_ED25519_PRIVATE_PREFIX + bytes(self._signing_key) + self.public_key)
            yield path
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
            os.rmdir(folder)

    def lock(self) -> None:
        """Claim this key for this process: two live peers with one key would share a peer ID.

        Raises IdentityError if another peer on this machine holds the key. Released by `unlock` or at exit.
        """
        if self.path is None or self._lock_fd is not None:
            return
        lock_path = self.path.with_name(self.path.name + ".lock")
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise IdentityError(
                f"identity key {self.path} is in use by another running peer on this machine; give each "
                f"peer its own key (swarm.peer --identity-key PATH, swarm.Trainer(identity_key=PATH))"
            ) from None
        self._lock_fd = fd

    def unlock(self) -> None:
        """Release `lock` (a peer that left): the key may serve a later peer of this process. Idempotent."""
        if self._lock_fd is not None:
            fd, self._lock_fd = self._lock_fd, None
            os.close(fd)

    @property
    def public_key(self) -> bytes:
        return bytes(self._signing_key.verify_key)

    @property
    def short_id(self) -> str:
        """A short printable fingerprint of the public key."""
        return self.public_key.hex()[:16]

    def sign(self, *, kind: str, run_id: str, payload: bytes) -> bytes:
        return self._signing_key.sign(signed_bytes(kind=kind, run_id=run_id, payload=payload)).signature

    def bind(self, peer_id: str) -> PeerBinding:
        """Sign a binding of this key to the libp2p ``peer_id``."""
        unsigned = PeerBinding(peer_id=peer_id, public_key=self.public_key, signature=b"")
        signature = self.sign(kind=BINDING_KIND, run_id="", payload=unsigned.payload())
        return PeerBinding(peer_id=peer_id, public_key=self.public_key, signature=signature)

    @classmethod
    def generate(cls) -> Identity:
        return cls(SigningKey.generate())

    @classmethod
    def of(cls, identity: Identity | None, key_path: str | os.PathLike | None) -> Identity:
        """``identity``, or the key at ``key_path``, by default ``~/.swarm/identity.key`` as swarm.peer's
        (`load_or_create`): a restarted peer is the same peer of its run."""
        if identity is not None and key_path is not None:
            raise TypeError("pass identity= or identity_key=, not both")
        return identity if identity is not None else cls.load_or_create(key_path)

    @classmethod
    def load_or_create(cls, path: str | os.PathLike | None = None) -> Identity:
        """Load the key at ``path`` (default ``~/.swarm/identity.key``), creating it (0600) if absent.

        Raises IdentityError, without touching the file, if it is group/world-accessible, unreadable
        or corrupt.
        """
        key_path = Path(path if path is not None else DEFAULT_IDENTITY_PATH).expanduser()
        if key_path.exists() or key_path.is_symlink():
            return cls(_read_key_file(key_path), path=key_path)
        return cls(_create_key_file(key_path), path=key_path)


def _read_key_file(path: Path) -> SigningKey:
    try:
        mode = path.stat().st_mode
    except OSError as e:
        raise IdentityError(f"cannot read identity key {path}: {e}") from None
    if not stat.S_ISREG(mode):
        raise IdentityError(f"identity key {path} is not a regular file")
    if mode & 0o077:
        raise IdentityError(
            f"identity key {path} is accessible by other users (mode {stat.S_IMODE(mode):o}); "
            f"it may be compromised. Fix with `chmod 600 {path}` if you trust it, or delete it to make a new one"
        )
    try:
        data = path.read_bytes()
    except OSError as e:
        raise IdentityError(f"cannot read identity key {path}: {e}") from None
    if not data.startswith(_KEY_FILE_MAGIC) or len(data) != len(_KEY_FILE_MAGIC) + 2 * _SEED_SIZE_BYTES + 1:
        raise IdentityError(f"identity key {path} is corrupt (not a Swarm Ed25519 key); delete it to make a new one")
    try:
        seed = bytes.fromhex(data[len(_KEY_FILE_MAGIC) :].decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise IdentityError(f"identity key {path} is corrupt (bad hex); delete it to make a new one") from None
    if len(seed) != _SEED_SIZE_BYTES:  # fromhex skips whitespace, so a padded file can hold a short seed
        raise IdentityError(f"identity key {path} is corrupt ({len(seed)}-byte seed); delete it to make a new one")
    return SigningKey(seed)


def _create_key_file(path: Path) -> SigningKey:
    signing_key = SigningKey.generate()
    contents = _KEY_FILE_MAGIC + bytes(signing_key).hex().encode() + b"\n"
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # O_EXCL: never overwrite a key another process created meanwhile; 0600 from the first byte.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        raise IdentityError(f"cannot create identity key {path}: {e}") from None
    with os.fdopen(fd, "wb") as f:
        f.write(contents)
        f.flush()
        os.fsync(f.fileno())
    return signing_key
