"""A local, content-addressed checkpoint store: safetensors shards and signed manifests.

Layout under ``root``::

    shards/<sha256 hex>.safetensors     one shard, named by the SHA-256 of its bytes
    manifests/<manifest digest>.json    a SignedManifest (wire format), named by Manifest.digest()

Guarantees the caller may rely on:

- A file appears under its final name only complete: it is written to a temp file in the same
  folder, fsynced, then renamed (``os.replace``). Leftover temp files from a crash are never read
  and :meth:`CheckpointStore.prune` removes stale ones.
- Every read of a shard re-hashes it, so corruption at rest is detected, and tensors are only ever
  parsed with ``safetensors`` after a strict header check: pickle is never loaded.
  :meth:`CheckpointStore.load_fetching` removes a shard found corrupt at rest and fetches it again.
- Refusals raise :class:`ShardRejected` with a short ``reason``, are logged, and are counted in
  ``store.rejected``.

The store does not verify manifest signatures: verify with
:func:`swarm.checkpoint.manifest.verify_manifest` before :meth:`CheckpointStore.put_manifest`.
When downloading a checkpoint, put its manifest first, then its shards, so that a concurrent
:meth:`CheckpointStore.prune` keeps the shards as they arrive.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from bootstrap.errors import Rejected
from swarm.checkpoint._private import HeaderError, not_safetensors, parse_header
from swarm.checkpoint.manifest import ALLOWED_DTYPES, Manifest, ManifestRejected, ShardInfo, SignedManifest, TensorInfo

logger = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_BYTES = 64 << 20
_SHARD_SUFFIX = ".safetensors"
_MANIFEST_SUFFIX = ".json"
_TEMP_PREFIX = ".tmp-"
_STALE_TEMP_S = 3600.0
_HEX64 = re.compile(r"[0-9a-f]{64}")
_TORCH_DTYPES = {name: getattr(torch, name) for name in ALLOWED_DTYPES}

__all__ = ["DEFAULT_MAX_SHARD_BYTES", "CheckpointStore", "PruneResult", "ShardInfo", "ShardRejected", "TensorInfo"]


class ShardRejected(Rejected):
    """A shard was refused. ``reason`` is a short fixed string (a counter key); ``detail`` says more.

    Reasons: ``digest mismatch``, ``size mismatch``, ``not safetensors``, ``unexpected dtype``,
    ``shape mismatch``, ``tensor names mismatch``.
    """

    what = "shard"


@dataclass(frozen=True, kw_only=True, slots=True)
class PruneResult:
    """What :meth:`CheckpointStore.prune` removed."""

    removed_manifests: int
    """Manifest files removed (older than the newest ``keep_last``, not pinned, or unreadable)."""
    removed_shards: int
    """Shard files that no kept manifest references."""
    removed_temp_files: int
    """Stale temp files left by interrupted writes."""


class CheckpointStore:
    """Shards and manifests under ``root`` (created if absent). One owner process per root."""

    def __init__(self, root: Path, *, keep_last: int = 3):
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last must be an int >= 1, got {keep_last!r}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.shards_dir = self.root / "shards"
        self.manifests_dir = self.root / "manifests"
        self.shards_dir.mkdir(parents=True, exist_ok=True)
        self.manifests_dir.mkdir(parents=True, exist_ok=True)
        self.rejected: Counter[str] = Counter()
        """Refusals by reason (shards, and manifests found corrupt in the store)."""
        self._parsed: dict[str, tuple[bytes, Manifest]] = {}
        """Manifest files already parsed and checked, by name: (their bytes, the manifest). A file whose
        bytes changed since is parsed and checked again."""

    # ---- shards ----

    def shard_path(self, digest: str) -> Path:
        """Where the shard with this digest lives (whether or not it is present)."""
        if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
            raise ValueError(f"a shard digest is 64 lowercase hex chars (SHA-256), got {digest!r:.80}")
        return self.shards_dir / f"{digest}{_SHARD_SUFFIX}"

    def has(self, digest: str) -> bool:
        """True if a shard with this digest is stored (not re-hashed here; reads re-hash)."""
        return self.shard_path(digest).is_file()

    def put_tensors(
        self, tensors: dict[str, torch.Tensor], *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    ) -> list[ShardInfo]:
        """Store a state dict as shards of at most ``max_shard_bytes`` of tensor data each.

        Tensors are grouped in order; a single tensor larger than the cap gets a shard of its own.
        Writing a shard that is already stored is a no-op. Raises ValueError/TypeError for tensors
        that cannot be stored (not a tensor, sparse, or a dtype outside ALLOWED_DTYPES).
        """
        if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
        for name, tensor in tensors.items():
            _check_storable(name, tensor)
        return [
            self._put_group(f"shard-{index:05d}", group)
            for index, group in enumerate(_group_by_size(tensors, max_shard_bytes))
        ]

    def put_shard_bytes(self, data: bytes, *, expected_digest: str, expected_size_bytes: int | None = None) -> Path:
        """Store a downloaded shard after checking its digest (and size) and its safetensors header.

        Raises ShardRejected (nothing is written) with reason ``size mismatch``, ``digest mismatch``,
        ``not safetensors`` or ``unexpected dtype``. Returns the shard's path.
        """
        path = self.shard_path(expected_digest)
        if expected_size_bytes is not None and len(data) != expected_size_bytes:
            raise self._reject(
                "size mismatch",
                f"{len(data)} bytes received, {expected_size_bytes} expected for shard {expected_digest[:16]}",
            )
        actual = hashlib.sha256(data).hexdigest()
        if actual != expected_digest:
            raise self._reject(
                "digest mismatch", f"received bytes hash to {actual[:16]}, expected {expected_digest[:16]}"
            )
        self._parse_header(data, expected_digest)
        if not path.is_file():
            _atomic_write(path, data)
        return path

    def read_shard(self, digest: str) -> bytes:
        """The shard's bytes, re-hashed on every read; ShardRejected("digest mismatch") if corrupt.

        Raises FileNotFoundError if the shard is not stored.
        """
        path = self.shard_path(digest)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise FileNotFoundError(
                f"shard {digest} is not in the store at {self.root}; fetch it from a donor first"
            ) from None
        actual = hashlib.sha256(data).hexdigest()
        if actual != digest:
            raise self._reject(
                "digest mismatch",
                f"stored file {path} hashes to {actual[:16]}: corrupt at rest; delete it and fetch the shard again",
            )
        return data

    def load_tensors(self, shard: ShardInfo) -> dict[str, torch.Tensor]:
        """The shard's tensors, after checking digest, size, and names/dtypes/shapes against ``shard``.

        Parsing uses ``safetensors`` only (never torch.load or pickle). Raises ShardRejected.
        """
        data = self.read_shard(shard.digest)
        if len(data) != shard.size_bytes:
            raise self._reject(
                "size mismatch", f"shard {shard.name} is {len(data)} bytes, manifest says {shard.size_bytes}"
            )
        self._check_declared(shard, self._parse_header(data, shard.digest))
        try:
            tensors = safetensors_load(data)
        except (SafetensorError, ValueError, RuntimeError) as e:
            raise self._reject(*_reason_detail(not_safetensors(str(e), data))) from None
        actual = tuple(
            TensorInfo(name=n, dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape))
            for n, t in tensors.items()
        )
        self._check_declared(shard, actual)
        return {info.name: tensors[info.name] for info in shard.tensors}

    def load_state_dict(self, manifest: Manifest) -> dict[str, torch.Tensor]:
        """All tensors of a manifest, each shard checked as in :meth:`load_tensors`."""
        state: dict[str, torch.Tensor] = {}
        for shard in manifest.shards:
            state.update(self.load_tensors(shard))
        return state

    def missing_shards(self, manifest: Manifest) -> list[ShardInfo]:
        """The manifest's shards that are not stored yet (to fetch from donors)."""
        return [shard for shard in manifest.shards if not self.has(shard.digest)]

    def load_fetching(self, manifest: Manifest, fetch: Callable[[list[ShardInfo]], None]) -> dict[str, torch.Tensor]:
        """:meth:`load_state_dict`, after ``fetch`` stored the shards that are missing (it is not called when
        none is). A stored shard whose bytes no longer hash to its name (corrupt at rest: a bad disk, a stray
        write) is removed and fetched once more; any other refusal, or a second one, is raised."""
        if missing := self.missing_shards(manifest):
            fetch(missing)
        try:
            return self.load_state_dict(manifest)
        except ShardRejected as e:
            if e.reason != "digest mismatch" or not (removed := self.discard_corrupt(manifest)):
                raise
        logger.warning("removed %d shard(s) corrupt at rest in %s; fetching them again", len(removed), self.root)
        fetch(self.missing_shards(manifest))
        return self.load_state_dict(manifest)

    def discard_corrupt(self, manifest: Manifest) -> list[str]:
        """Remove the manifest's stored shards whose bytes no longer hash to their names, so that they count
        as missing again; their digests (each counted as "corrupt at rest, removed")."""
        removed = []
        for shard in manifest.shards:
            path = self.shard_path(shard.digest)
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                continue
            if hashlib.sha256(data).hexdigest() != shard.digest and _remove(path):
                self._count("corrupt at rest, removed", f"stored shard {shard.digest[:16]} ({path})")
                removed.append(shard.digest)
        return removed

    # ---- manifests ----

    def put_manifest(self, manifest_bytes: bytes) -> str:
        """Store a signed manifest (wire format) under its digest and return the digest.

        The bytes must parse (SignedManifest.from_bytes; ManifestRejected otherwise) but their
        signatures are not checked here. Storing the same manifest again replaces its signatures.
        Its shards need not be present yet.
        """
        signed = SignedManifest.from_bytes(manifest_bytes)
        digest = signed.manifest.digest()
        _atomic_write(self.manifests_dir / f"{digest}{_MANIFEST_SUFFIX}", signed.to_bytes())
        return digest

    def get_manifest(self, digest: str) -> bytes:
        """The stored signed manifest's bytes; FileNotFoundError if absent.

        Raises ManifestRejected("digest mismatch") if the file no longer matches its name.
        """
        if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
            raise ValueError(f"a manifest digest is 64 lowercase hex chars, got {digest!r:.80}")
        data = (self.manifests_dir / f"{digest}{_MANIFEST_SUFFIX}").read_bytes()
        try:
            actual = SignedManifest.from_bytes(data).manifest.digest()
        except ManifestRejected as e:
            self._count("corrupt manifest", f"stored manifest {digest[:16]}: {e}")
            raise
        if actual != digest:
            self._count("manifest digest mismatch", f"stored manifest {digest[:16]} now hashes to {actual[:16]}")
            raise ManifestRejected("digest mismatch", f"stored manifest {digest[:16]} hashes to {actual[:16]}")
        return data

    def list_manifests(self) -> list[str]:
        """Digests of the stored, readable manifests, oldest step first (ties: created_at, digest)."""
        return [digest for digest, _ in self._manifest_index()]

    def prune(self, keep: set[str] | None = None) -> PruneResult:
        """Keep the newest ``keep_last`` manifests (by step) plus those in ``keep``; drop the rest.

        Also removes every shard that no kept manifest references, unreadable manifest files and
        temp files older than an hour (interrupted writes; younger ones may be in progress).
        """
        index = self._manifest_index()
        kept = {digest for digest, _ in index[-self.keep_last :]} | set(keep or ())
        referenced = {shard.digest for digest, manifest in index if digest in kept for shard in manifest.shards}
        removed_manifests = 0
        for path in _final_files(self.manifests_dir, _MANIFEST_SUFFIX):
            if path.name.removesuffix(_MANIFEST_SUFFIX) not in kept:
                removed_manifests += _remove(path)
        removed_shards = sum(
            _remove(path)
            for path in _final_files(self.shards_dir, _SHARD_SUFFIX)
            if path.name.removesuffix(_SHARD_SUFFIX) not in referenced
        )
        removed_temp = sum(
            _remove(path) for folder in (self.shards_dir, self.manifests_dir) for path in _stale_temp_files(folder)
        )
        return PruneResult(
            removed_manifests=removed_manifests, removed_shards=removed_shards, removed_temp_files=removed_temp
        )

    # ---- internals ----

    def _manifest_index(self) -> list[tuple[str, Manifest]]:
        index = []
        parsed: dict[str, tuple[bytes, Manifest]] = {}
        for path in _final_files(self.manifests_dir, _MANIFEST_SUFFIX):
            digest = path.name.removesuffix(_MANIFEST_SUFFIX)
            try:
                data = path.read_bytes()
                known = self._parsed.get(path.name)
                if known is not None and known[0] == data:
                    manifest = known[1]  # checked already: sealing prunes every round, reading each file again
                else:
                    manifest = SignedManifest.from_bytes(data).manifest
                    if manifest.digest() != digest:
                        self._count("manifest digest mismatch", f"skipping stored manifest {path}: contents changed")
                        continue
            except (ManifestRejected, OSError) as e:
                self._count("corrupt manifest", f"skipping stored manifest {path}: {e}")
                continue
            parsed[path.name] = (data, manifest)
            index.append((digest, manifest))
        self._parsed = parsed
        index.sort(key=lambda item: (item[1].step, item[1].created_at, item[0]))
        return index

    def _put_group(self, name: str, group: list[tuple[str, torch.Tensor]]) -> ShardInfo:
        data = safetensors_save(_unshared(group))
        digest = hashlib.sha256(data).hexdigest()
        path = self.shard_path(digest)
        if not path.is_file():
            _atomic_write(path, data)
        infos = tuple(
            TensorInfo(name=n, dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape)) for n, t in group
        )
        return ShardInfo(name=name, digest=digest, size_bytes=len(data), tensors=infos)

    def _parse_header(self, data: bytes, digest: str) -> tuple[TensorInfo, ...]:
        try:
            return parse_header(data)
        except HeaderError as e:
            reason, detail = _reason_detail(e)
            raise self._reject(reason, f"shard {digest[:16]}: {detail}") from None

    def _check_declared(self, shard: ShardInfo, actual: tuple[TensorInfo, ...]) -> None:
        declared = {t.name: t for t in shard.tensors}
        found = {t.name: t for t in actual}
        if set(declared) != set(found):
            extra, missing = sorted(set(found) - set(declared)), sorted(set(declared) - set(found))
            raise self._reject(
                "tensor names mismatch", f"shard {shard.name}: unexpected {extra!r:.200}, missing {missing!r:.200}"
            )
        for name, info in found.items():
            if info.dtype != declared[name].dtype:
                raise self._reject(
                    "unexpected dtype",
                    f"shard {shard.name} tensor {name!r}: {info.dtype}, manifest says {declared[name].dtype}",
                )
            if info.shape != declared[name].shape:
                raise self._reject(
                    "shape mismatch",
                    f"shard {shard.name} tensor {name!r}: {list(info.shape)}, "
                    f"manifest says {list(declared[name].shape)}",
                )

    def _reject(self, reason: str, detail: str) -> ShardRejected:
        self._count(reason, detail)
        return ShardRejected(reason, detail)

    def _count(self, reason: str, detail: str) -> None:
        self.rejected[reason] += 1
        logger.warning("checkpoint store %s refused data: %s (%s)", self.root, reason, detail)


def _reason_detail(error: HeaderError) -> tuple[str, str]:
    return error.reason, error.detail


def _check_storable(name: str, tensor: torch.Tensor) -> None:
    if not isinstance(name, str) or not name:
        raise TypeError(f"state dict keys must be non-empty strings, got {name!r:.80}")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError(f"{name!r}: only dense tensors can be stored, got layout {tensor.layout}")
    if tensor.dtype not in _TORCH_DTYPES.values():
        raise ValueError(f"{name!r}: dtype {tensor.dtype} cannot be stored; allowed: {ALLOWED_DTYPES}")


def _group_by_size(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    group: list[tuple[str, torch.Tensor]] = []
    group_bytes = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if group and group_bytes + size > max_shard_bytes:
            yield group
            group, group_bytes = [], 0
        group.append((name, tensor))
        group_bytes += size
    if group:
        yield group


def _unshared(group: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies safetensors accepts: tensors sharing a storage (tied weights) are cloned."""
    result: dict[str, torch.Tensor] = {}
    seen_storages: set[int] = set()
    for name, tensor in group:
        tensor = tensor.detach().cpu().contiguous()
        pointer = tensor.untyped_storage().data_ptr()
        if tensor.numel() and pointer in seen_storages:
            tensor = tensor.clone()
        seen_storages.add(tensor.untyped_storage().data_ptr())
        result[name] = tensor
    return result


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that the final name only ever holds the complete bytes."""
    fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=_TEMP_PREFIX, suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp_name)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def _final_files(folder: Path, suffix: str) -> Iterable[Path]:
    for path in folder.iterdir():
        if path.name.endswith(suffix) and _HEX64.fullmatch(path.name.removesuffix(suffix)) and path.is_file():
            yield path


def _stale_temp_files(folder: Path) -> Iterable[Path]:
    cutoff = time.time() - _STALE_TEMP_S
    for path in folder.iterdir():
        if not path.name.startswith(_TEMP_PREFIX):
            continue
        try:
            modified = path.stat().st_mtime
        except FileNotFoundError:
            continue
        if modified < cutoff:
            yield path


def _remove(path: Path) -> int:
    try:
        path.unlink()
    except FileNotFoundError:
        return 0
    return 1
