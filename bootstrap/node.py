"""The bootstrap DHT node (`python -m bootstrap`) and the DHT start-up helpers other peers reuse.

Reusable, documented entry points: `parse_initial_peers`, `check_identity_file`, `ensure_identity`,
`start_dht`, `stop_dht`, `visible_maddrs`, `initial_peers_line`, `num_known_peers`.
The node itself: `BootstrapConfig`, `build_parser`, `config_from_args`, `run`, `main`; with
`--metrics-port` it also serves Prometheus metrics (`bootstrap.metrics.BootstrapMetrics`).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import os
import re
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

import hivemind
import psutil
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.multiaddr import Multiaddr

from bootstrap._private import procs
from bootstrap.errors import StartError, one_line
from bootstrap.lifetime import StopSignal, freeze_heap_at_exit, start_reaper
from bootstrap.metrics import BootstrapMetrics
from bootstrap.owned import OwnerBoundValidator, dht_owned_rejections
from bootstrap.records import PeerRecordValidator, dht_record_rejections

__all__ = [
    "DEFAULT_HOST_MADDRS",
    "DEFAULT_IDENTITY_PATH",
    "BootstrapConfig",
    "DHTStartError",
    "build_parser",
    "check_identity_file",
    "config_from_args",
    "ensure_identity",
    "initial_peers_line",
    "main",
    "num_known_peers",
    "parse_initial_peers",
    "run",
    "start_dht",
    "stop_dht",
    "visible_maddrs",
]

logger = logging.getLogger(__name__)

DEFAULT_IDENTITY_PATH = Path("~/.swarm/bootstrap.id")
DEFAULT_HOST_MADDRS = ("/ip4/0.0.0.0/tcp/31337",)
_UNSPECIFIED_HOSTS = {"0.0.0.0", "::"}
_RPC_TIMEOUT_S = 10.0
_GRACEFUL_STOP_S = 1.0
_CANCEL_POLL_S = 0.1
_LOCK_PROBE_S = 5.0
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_METRICS_REFRESH_S = 5.0
_METRICS_CLOSE_S = 2.0


class DHTStartError(StartError):
    """The DHT did not start; the message names the address or file at fault and what to do."""


# --- validation ---------------------------------------------------------------------------------


def _parse_maddr(name: str, value: str) -> Multiaddr:
    try:
        return Multiaddr(value)
    except Exception as e:  # the multiaddr parser raises several unrelated exception types
        raise ValueError(f"{name}: {value!r} is not a valid multiaddr ({one_line(e)})") from e


def _value(maddr: Multiaddr, protocol: str) -> str | None:
    """The value of `protocol` in `maddr` (e.g. the port for "tcp"), or None if absent."""
    return maddr[protocol] if protocol in [p.name for p in maddr.protocols()] else None


def parse_initial_peers(maddrs: Iterable[str]) -> list[str]:
    """Validate peer addresses of the form /ip4/HOST/tcp/PORT/p2p/PEER_ID; return them canonical.

    Order is kept and duplicates are dropped. Raises `ValueError` naming the first bad address:
    not a multiaddr, no /p2p/ part, a peer id that does not parse, or no transport before /p2p/.
    Performs no network I/O.
    """
    peers: list[str] = []
    for raw in maddrs:
        value = str(raw).strip()
        maddr = _parse_maddr("initial_peers", value)
        protocols = [proto.name for proto in maddr.protocols()]
        if "p2p" not in protocols:
            raise ValueError(f"initial_peers: {value!r} has no /p2p/PEER_ID part; copy the whole address")
        try:
            PeerID.from_base58(maddr["p2p"])
        except Exception as e:
            raise ValueError(f"initial_peers: {value!r} has a bad peer id ({one_line(e)})") from e
        if protocols[0] == "p2p":
            raise ValueError(f"initial_peers: {value!r} has no address before /p2p/ (e.g. /ip4/HOST/tcp/PORT)")
        if str(maddr) not in peers:
            peers.append(str(maddr))
    return peers


def check_identity_file(path: str | os.PathLike[str]) -> PeerID:
    """Return the peer id stored in an existing libp2p identity file, never modifying the file.

    Raises `ValueError` ("cannot read identity file PATH: ...; delete it to generate a new one") if
    it is missing, not a regular file, unreadable or not a libp2p private key, and if group or
    others may access it (the private key would leak: fix with chmod 600).
    """
    path = Path(path).expanduser()
    hint = "delete it to generate a new one"
    try:
        if not path.is_file():
            raise ValueError(f"cannot read identity file {path}: not a regular file; {hint}")
        data = path.read_bytes()
        mode = path.stat().st_mode & 0o777
    except OSError as e:
        raise ValueError(f"cannot read identity file {path}: {e.strerror or e}; {hint}") from e
    try:
        peer_id = _peer_id_of_identity(data)
    except Exception as e:  # protobuf and cryptography raise various exception types
        reason = one_line(e)
        raise ValueError(f"cannot read identity file {path}: not a libp2p private key ({reason}); {hint}") from e
    if mode & 0o077:
        raise ValueError(
            f"identity file {path} is accessible by group/others (mode {mode:o}); it holds a private key: "
            f"run `chmod 600 {path}`"
        )
    return peer_id


def _peer_id_of_identity(data: bytes) -> PeerID:
    """Peer id of a libp2p private key file: RSA (hivemind's own) or Ed25519 (Swarm peers' identity keys)."""
    key = crypto_pb2.PrivateKey.FromString(data)
    if key.key_type == crypto_pb2.KeyType.Ed25519:
        if len(key.data) != 64:
            raise ValueError(f"an Ed25519 key holds 64 bytes, got {len(key.data)}")
        public = crypto_pb2.PublicKey(key_type=crypto_pb2.KeyType.Ed25519, data=key.data[32:]).SerializeToString()
        return PeerID(b"\x00" + bytes([len(public)]) + public)  # identity multihash, as libp2p does for small keys
    return PeerID.from_identity(data)


def ensure_identity(path: str | os.PathLike[str]) -> PeerID:
    """Return the peer id of the identity at `path`, creating a new RSA identity if none exists.

    A new file is written in hivemind's format with mode 0400 (its parent directory is created
    with mode 0700) and appears atomically; an existing file is only read (`check_identity_file`).
    """
    return _ensure_identity(Path(path).expanduser())[0]


def _ensure_identity(path: Path) -> tuple[PeerID, bool]:
    """`ensure_identity`, also telling whether the file was created just now."""
    if path.exists() or path.is_symlink():
        return check_identity_file(path), False
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=RSAPrivateKey().to_bytes())
    data = key.SerializeToString()
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.link(tmp, path)  # fails instead of overwriting if someone created `path` meanwhile
    except FileExistsError:
        return check_identity_file(path), False
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return PeerID.from_identity(data), True


# --- DHT start / stop ---------------------------------------------------------------------------


def _unreachable(peers: Sequence[str], reason: str, elapsed_s: float) -> DHTStartError:
    noun = "peer" if len(peers) == 1 else "peers"
    return DHTStartError(
        f"cannot reach bootstrap {noun} {' '.join(peers)}: {reason} after {elapsed_s:.1f} s; "
        f"is the node running and the port open?"
    )


def _port_open(maddr: str, timeout_s: float = 2.0) -> bool:
    """Whether something accepts TCP connections at ``maddr``'s host and port (False when it has none)."""
    match = re.match(r"^/(?:ip4|ip6|dns|dns4|dns6)/([^/]+)/tcp/(\d+)(?:/|$)", maddr)
    if match is None:
        return False
    try:
        with socket.create_connection((match[1], int(match[2])), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def _explain(
    error: BaseException,
    *,
    peers: Sequence[str],
    host_maddrs: Sequence[str],
    identity_path: Path | None,
    elapsed_s: float,
) -> DHTStartError:
    text = one_line(error)
    if "address already in use" in text:
        return DHTStartError(
            f"cannot listen on {' '.join(host_maddrs)}: address already in use; "
            f"stop the process using that port or choose another one"
        )
    if "failed to connect to bootstrap peers" in text or "none of the initial_peers responded" in text:
        listening = [peer for peer in peers if _port_open(peer)]
        if listening and len(listening) == len(peers):  # the port answers: the peer ID is what is wrong
            noun = "peer" if len(peers) == 1 else "peers"
            return DHTStartError(
                f"cannot reach bootstrap {noun} {' '.join(peers)}: the port answers, but not as the peer ID "
                f"after /p2p/; copy the address from the node's `--initial-peers` line (printed when it starts)"
            )
        return _unreachable(peers, "connection failed", elapsed_s)
    if "already taken by another peer" in text:
        return DHTStartError(
            f"identity {identity_path} is already in use by a running peer in this swarm; "
            f"stop that peer or use another identity file"
        )
    return DHTStartError(f"DHT failed to start: {text}")


def _tree(dht: hivemind.DHT) -> list[psutil.Process]:
    """The DHT child and everything below it (p2pd); empty once it is gone."""
    try:
        root = psutil.Process(dht.pid)
        return [root, *procs.descendants(root)]
    except psutil.NoSuchProcess:
        return []


def _kill_tree(dht: hivemind.DHT, grace_s: float) -> None:
    """Terminate the DHT child and everything below it (p2pd), without its cooperation."""
    if dht.pid is None:
        return
    procs.terminate_all(_tree(dht), grace_s)
    dht.join(timeout=grace_s)


def _wait_until_ready(dht: hivemind.DHT, timeout_s: float, cancel: threading.Event | None) -> None:
    if cancel is None:
        dht.wait_until_ready(timeout=timeout_s)
        return
    deadline = time.monotonic() + timeout_s
    while not cancel.is_set():
        try:
            dht.wait_until_ready(timeout=max(0.0, min(_CANCEL_POLL_S, deadline - time.monotonic())))
            return
        except concurrent.futures.TimeoutError:
            if time.monotonic() >= deadline:
                raise
    raise KeyboardInterrupt  # raised here, in our own frame: see `StopSignal`


def heal_mpfuture_backend(probe_s: float | None = None) -> bool:
    """Reset hivemind's `MPFuture` backend if a dead child left its lock held; True if it did (logged).

    The backend is process-wide: every DHT child a process forks sends each reply (its ``ready`` signal too)
    down one pipe under one cross-process lock, ``MPFuture._update_lock``. A child killed while it held that
    lock (SIGKILL or SIGTERM in mid-reply: a crash, or a test's or benchmark's kill of an in-process DHT)
    leaves it held for good, and every later DHT of the process hangs at its start (one pytest worker failed
    7 DHT starts in a row with "DHT did not start within 30.0 s"). A lock no live writer holds is free at
    once; if it is not free within ``probe_s`` (default 5 s), the backend is reset (`MPFuture.reset_backend`): new locks
    and a new pipe for the DHTs started from now on. Those already running needed the held lock to answer,
    so they were stuck before the reset."""
    probe_s = _LOCK_PROBE_S if probe_s is None else probe_s
    for name in ("_update_lock", "_initialization_lock"):
        lock = getattr(MPFuture, name)
        if lock.acquire(timeout=probe_s):
            lock.release()
            continue
        logger.warning(
            "hivemind's MPFuture.%s was held for %.1f s (a DHT process died holding it): reset", name, probe_s
        )
        MPFuture.reset_backend()
        return True
    return False


_shm_manager: tuple[int, Any] | None = None
"""(pid, a shared tensor) of the process that started torch's shared-memory manager (a forked child has its
own); the tensor is kept so that the manager keeps a client."""


def start_shm_manager() -> None:
    """Start torch's shared-memory manager now, with SIGINT and SIGTERM blocked in this thread; once a process.

    hivemind sets torch's sharing strategy to "file_system", and its first `MPFuture` (inside
    `hivemind.DHT.__init__`) allocates shared memory: torch then forks `torch_shm_manager` and reads
    its handshake in libshm's `start_manager()`. A signal that interrupts that read leaves the thread
    spinning inside `start_manager()` at full CPU, for good: a Ctrl+C or SIGTERM 2.6-2.9 s into
    `swarm.peer`'s start-up hung it in 3 of 8 tries (torch 2.13; gdb shows the thread in
    `start_manager`, the manager a zombie). With both signals blocked here nothing interrupts it; a
    signal sent meanwhile goes to another thread or waits until the mask is restored, and the
    process's handlers see it then. The manager inherits the mask, so a terminal's Ctrl+C does not kill
    it under a process still shutting down; it exits by itself when its last client has gone.
    """
    global _shm_manager
    if _shm_manager is not None and _shm_manager[0] == os.getpid():
        return
    import torch.multiprocessing

    shared = None
    if torch.multiprocessing.get_sharing_strategy() == "file_system":
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            shared = torch.empty(1, dtype=torch.uint8).share_memory_()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    _shm_manager = (os.getpid(), shared)


def start_dht(
    initial_peers: Sequence[str] = (),
    *,
    host_maddrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
    announce_maddrs: Sequence[str] = (),
    identity_path: str | os.PathLike[str] | None = None,
    connect_timeout_s: float = 30.0,
    client_mode: bool = False,
    cancel: threading.Event | None = None,
    **dht_kwargs: Any,
) -> hivemind.DHT:
    """Start a `hivemind.DHT` and return it once it serves requests and has reached a peer.

    `initial_peers` are validated with `parse_initial_peers` (no network I/O), an identity file
    with `ensure_identity`. Within `connect_timeout_s` the DHT must be up and, if `initial_peers`
    are given, know at least one peer; otherwise its process tree (DHT child, p2pd) is killed and
    `DHTStartError` is raised naming the unreachable address, the busy port or the identity.
    Bad arguments raise `ValueError`. `dht_kwargs` go to `hivemind.DHT` (and on to DHTNode/P2P),
    e.g. `record_validators`, `nat_port_map`. Stop the result with `stop_dht`. Once `cancel` is set
    (e.g. `StopSignal.event`), the start-up wait gives up within ~0.1 s: the process tree is killed
    and KeyboardInterrupt is raised; so is an error that reaches us after `cancel` was set.
    """
    if not (math.isfinite(connect_timeout_s) and connect_timeout_s > 0):
        raise ValueError(f"connect_timeout_s must be a positive number of seconds, got {connect_timeout_s!r}")
    peers = parse_initial_peers(initial_peers)
    hosts = [str(_parse_maddr("host_maddrs", m)) for m in host_maddrs]
    announce = [str(_parse_maddr("announce_maddrs", m)) for m in announce_maddrs]
    identity = Path(identity_path).expanduser() if identity_path is not None else None
    if identity is not None and _ensure_identity(identity)[1]:
        # hivemind would dial the swarm to check that a brand-new key is not in use: it cannot be
        dht_kwargs.setdefault("check_if_identity_free", False)
    dht_kwargs.setdefault("startup_timeout", connect_timeout_s)  # hivemind's own p2pd start-up bound

    started = time.monotonic()
    heal_mpfuture_backend()
    start_shm_manager()
    freeze_heap_at_exit()
    dht = hivemind.DHT(
        initial_peers=peers or None,
        start=True,
        await_ready=False,
        host_maddrs=hosts,
        announce_maddrs=announce or None,
        identity_path=str(identity) if identity is not None else None,
        client_mode=client_mode,
        **dht_kwargs,
    )
    try:
        _wait_until_ready(dht, connect_timeout_s, cancel)
        if peers and num_known_peers(dht, timeout_s=connect_timeout_s) == 0:
            raise _unreachable(peers, "joined but found no DHT peer", time.monotonic() - started)
    except BaseException as error:
        _kill_tree(dht, grace_s=2.0)
        if cancel is not None and cancel.is_set():
            # the stop request came while the error was on its way (e.g. the peers we dialled were stopping
            # too): the caller asked to stop, and it has, so report the stop and not the error
            if isinstance(error, Exception):
                logger.info("stopped while starting the DHT (it was failing: %r)", error)
            raise KeyboardInterrupt from None
        elapsed_s = time.monotonic() - started
        if isinstance(error, concurrent.futures.TimeoutError):
            if peers:
                raise _unreachable(peers, "no answer", elapsed_s) from None
            raise DHTStartError(f"DHT did not start within {connect_timeout_s:.1f} s") from None
        if isinstance(error, DHTStartError) or not isinstance(error, Exception):
            raise
        raise _explain(error, peers=peers, host_maddrs=hosts, identity_path=identity, elapsed_s=elapsed_s) from error
    return dht


def stop_dht(dht: hivemind.DHT, *, timeout_s: float = 10.0) -> None:
    """Shut `dht` down and make sure its process and `p2pd` are gone; returns within ~`timeout_s`.

    Asks the DHT to shut down cleanly first, then terminates (and finally kills) whatever of its
    process tree is left. Safe to call twice or on a DHT whose process already died.
    """
    if dht.pid is None or dht.exitcode is not None:
        # never started, or already exited and reaped: its pid may now belong to an unrelated process,
        # and its orphaned children (if any) cannot be found from it any more (the reaper owns those)
        return
    tree = _tree(dht)
    deadline = time.monotonic() + timeout_s
    if dht.is_alive():
        # a clean shutdown takes ~10-50 ms; but if p2pd is already gone (Ctrl+C in a terminal reaches
        # it too), hivemind's hangs for its whole grace period: bound that by _GRACEFUL_STOP_S
        dht.shutdown_timeout = max(0.1, min(dht.shutdown_timeout, _GRACEFUL_STOP_S, timeout_s / 2))
        with contextlib.suppress(OSError, ValueError):  # the pipe may already be closed
            dht.shutdown()
    leftovers = procs.wait_gone(tree, max(0.0, deadline - time.monotonic() - 1.0))
    if leftovers:
        logger.warning("DHT processes %s outlived shutdown; terminating them", [p.pid for p in leftovers])
        procs.terminate_all(leftovers, grace_s=0.5)
    dht.join(timeout=1.0)


# --- queries ------------------------------------------------------------------------------------


async def _visible_maddrs(_dht: hivemind.DHT, node: hivemind.DHTNode) -> list[str]:
    return [str(maddr) for maddr in await node.get_visible_maddrs()]


async def _count_peers(_dht: hivemind.DHT, node: hivemind.DHTNode, refresh: bool) -> int:
    if refresh:
        # a lookup of a random key pings peers and drops the dead ones from the routing table
        with contextlib.suppress(Exception):
            await asyncio.wait_for(node.get(f"heartbeat_{secrets.token_hex(16)}", latest=True), _RPC_TIMEOUT_S)
    return len(node.protocol.routing_table.uid_to_peer_id)


def _call(dht: hivemind.DHT, coro: Any, timeout_s: float) -> Any:
    future = dht.run_coroutine(coro, return_future=True)
    try:
        return future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TimeoutError(f"the DHT process did not answer within {timeout_s:.1f} s") from None


def visible_maddrs(dht: hivemind.DHT, *, timeout_s: float = _RPC_TIMEOUT_S) -> list[str]:
    """Addresses other peers can dial, each ending in /p2p/<peer id>; unspecified hosts dropped.

    Raises `TimeoutError` if the DHT process does not answer within `timeout_s`.
    """
    maddrs = []
    for text in _call(dht, _visible_maddrs, timeout_s):
        maddr = Multiaddr(text)
        hosts = {_value(maddr, "ip4"), _value(maddr, "ip6")}
        if not hosts & _UNSPECIFIED_HOSTS and text not in maddrs:
            maddrs.append(text)
    return maddrs


def initial_peers_line(dht: hivemind.DHT, *, timeout_s: float = _RPC_TIMEOUT_S) -> str:
    """The copy-pasteable `--initial-peers MADDR [MADDR ...]` line for joining through `dht`."""
    maddrs = visible_maddrs(dht, timeout_s=timeout_s)
    if not maddrs:
        raise DHTStartError("the DHT has no dialable address; pass --announce-maddrs with a public address")
    return "--initial-peers " + " ".join(maddrs)


def num_known_peers(dht: hivemind.DHT, *, refresh: bool = False, timeout_s: float = _RPC_TIMEOUT_S) -> int:
    """Number of other DHT nodes in `dht`'s routing table.

    With `refresh`, first looks up a random key, which pings peers and evicts the dead ones.
    Raises `TimeoutError` if the DHT process does not answer within `timeout_s`.
    """
    return _call(dht, partial(_count_peers, refresh=refresh), timeout_s)


async def _ping_all(_dht: hivemind.DHT, node: hivemind.DHTNode, peer_ids: tuple[str, ...], timeout_s: float) -> int:
    async def ping(peer: str) -> bool:
        with contextlib.suppress(Exception):  # a bad id, a dead peer or a timeout: it just does not count
            peer_id = PeerID.from_base58(peer)
            if await asyncio.wait_for(node.protocol.call_ping(peer_id), timeout_s) is not None:
                # it is back: lift the ban its failed RPCs earned (hivemind's blacklist doubles it with each
                # failure, 5 s to 40 s over a 30 s cut, and skips a banned peer in every get and store)
                node.blacklist.register_success(peer_id)
                return True
        return False

    return sum(await asyncio.gather(*(ping(peer) for peer in peer_ids)))


def reconnect(
    dht: hivemind.DHT, peer_ids: Iterable[str], *, timeout_s: float = _RPC_TIMEOUT_S
) -> concurrent.futures.Future:
    """Ping `peer_ids` (at most 64, by peer ID: the daemon still knows the addresses of peers it met) so
    that each one that answers is back in `dht`'s routing table, and `dht` in its. Returns at once: a
    future of the number that answered.

    A hivemind DHT drops every node that fails an RPC, so after a network partition a node can be left
    knowing nobody, and the others have dropped it too; nothing brings them together again until one
    contacts the other. It also bans each of them from its gets and stores for a while (its blacklist):
    a peer that answers the ping is taken off it. Call this when a peer finds itself alone.
    """
    own = str(dht.peer_id)
    ids = tuple(dict.fromkeys(p for p in peer_ids if isinstance(p, str) and p and p != own))[:64]
    return dht.run_coroutine(partial(_ping_all, peer_ids=ids, timeout_s=timeout_s), return_future=True)


def peer_id_of_maddr(maddr: str) -> str | None:
    """The peer ID a multiaddr ends with (`.../p2p/<id>`), or None."""
    head, sep, tail = str(maddr).rpartition("/p2p/")
    return tail.split("/", 1)[0] or None if sep else None


# --- the bootstrap node -------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class BootstrapConfig:
    """Everything `python -m bootstrap` takes; one field per command-line flag."""

    identity: Path = DEFAULT_IDENTITY_PATH
    """Persistent libp2p identity (private key) file; created with mode 0400 on first run."""
    host_maddrs: tuple[str, ...] = DEFAULT_HOST_MADDRS
    """Multiaddrs to listen on."""
    announce_maddrs: tuple[str, ...] = ()
    """Multiaddrs to announce instead of the listening ones (e.g. a public IP); explicit ports."""
    initial_peers: tuple[str, ...] = ()
    """Peers of an existing swarm to join; empty starts a new swarm."""
    refresh_period_s: float = 30.0
    """Seconds between two log lines with the number of known peers."""
    connect_timeout_s: float = 30.0
    """Seconds to start the DHT and reach an initial peer before giving up with exit code 2."""
    nat_port_map: bool = False
    """Ask the local router for a port mapping (UPnP/NAT-PMP); off: a bootstrap needs a fixed address."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Log level: DEBUG, INFO, WARNING or ERROR."""
    metrics_port: int = 0
    """TCP port of the Prometheus endpoint http://METRICS_HOST:PORT/metrics; 0: no metrics server.
    Values are refreshed every min(refresh_period_s, 5) s."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics endpoint listens on: 127.0.0.1 keeps it local, 0.0.0.0 exposes it."""

    def __post_init__(self) -> None:
        if not self.host_maddrs:
            raise ValueError("host_maddrs: need at least one address to listen on, got none")
        for maddr in self.host_maddrs:
            _parse_maddr("host_maddrs", maddr)
        for maddr in self.announce_maddrs:
            parsed = _parse_maddr("announce_maddrs", maddr)
            if any(_value(parsed, proto) == "0" for proto in ("tcp", "udp")):
                raise ValueError(f"announce_maddrs: {maddr!r} has port 0; announce the real port")
        parse_initial_peers(self.initial_peers)
        for name in ("refresh_period_s", "connect_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: must be a positive number of seconds, got {value!r}")
        if self.log_level not in _LOG_LEVELS:
            raise ValueError(f"log_level: must be one of {', '.join(_LOG_LEVELS)}, got {self.log_level!r}")
        port = self.metrics_port
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"metrics_port: must be a TCP port in 1..65535, or 0 for none, got {port!r}")
        if not isinstance(self.metrics_host, str) or not self.metrics_host.strip():
            raise ValueError(f"metrics_host: must be an address such as 127.0.0.1, got {self.metrics_host!r}")


def build_parser() -> argparse.ArgumentParser:
    """The `python -m bootstrap` parser: one flag per `BootstrapConfig` field, its help the field's docstring."""
    from bootstrap.cli import add_dataclass_arguments

    parser = argparse.ArgumentParser(
        prog="python -m bootstrap",
        description="Run a Swarm bootstrap node: a long-lived DHT peer that new peers join through.",
    )
    add_dataclass_arguments(parser, BootstrapConfig)
    for action in parser._actions:
        if action.dest == "log_level":
            action.type = str.upper  # --log-level debug works too
    return parser


def config_from_args(args: argparse.Namespace) -> BootstrapConfig:
    """Map parsed flags one-to-one onto `BootstrapConfig`; raises `ValueError` on bad values."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(BootstrapConfig)}
    for name in ("host_maddrs", "announce_maddrs", "initial_peers"):
        values[name] = tuple(values[name])
    values["identity"] = Path(values["identity"]).expanduser()
    return BootstrapConfig(**values)


def _configure_logging(level: str) -> None:
    from bootstrap.cli import log_handler

    root = logging.getLogger("bootstrap")
    root.handlers[:] = [log_handler()]
    root.setLevel(level)
    root.propagate = False


def _print_banner(config: BootstrapConfig, line: str, metrics_url: str | None) -> None:
    from rich.console import Console

    console = Console(stderr=True, soft_wrap=True, highlight=False)
    console.print("[bold green]Swarm bootstrap node is running.[/]")
    console.print(f"identity: {config.identity}   listening on: {' '.join(config.host_maddrs)}")
    if metrics_url is not None:
        console.print(f"Prometheus metrics: {metrics_url}")
    console.print("Other peers join with:")
    console.print(f"  [bold cyan]{line}[/]")
    console.print("[dim]Ctrl+C or SIGTERM stops it.[/]")


async def _log_peers(dht: hivemind.DHT) -> None:
    future = dht.run_coroutine(partial(_count_peers, refresh=True), return_future=True)
    try:
        num_peers = await asyncio.wait_for(future, timeout=2 * _RPC_TIMEOUT_S)
    except asyncio.TimeoutError:
        logger.warning("the DHT process did not report its peers within %.0f s", 2 * _RPC_TIMEOUT_S)
        return
    finally:
        future.cancel()  # no-op once done; stops the lookup if we were cancelled or timed out
    logger.info("%d known DHT peers (not counting this node)", num_peers)


async def _serve(dht: hivemind.DHT, config: BootstrapConfig, stop: StopSignal) -> None:
    """Log the peer count every refresh period until `stop` is set (SIGINT or SIGTERM)."""
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()

    def on_stop() -> None:
        loop.call_soon_threadsafe(wake.set)

    stop.on_stop.append(on_stop)  # before the first check: a signal between the two still wakes us
    try:
        while not stop.event.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(wake.wait(), timeout=config.refresh_period_s)
                break
            log_task = asyncio.ensure_future(_log_peers(dht))
            wake_task = asyncio.ensure_future(wake.wait())
            await asyncio.wait({log_task, wake_task}, return_when=asyncio.FIRST_COMPLETED)
            for task in (log_task, wake_task):
                task.cancel()
            await asyncio.gather(log_task, wake_task, return_exceptions=True)
    finally:
        stop.on_stop.remove(on_stop)


def _fail(message: object) -> int:
    print(f"bootstrap: error: {one_line(message)}", file=sys.stderr, flush=True)
    return 2


def _start_metrics(dht: hivemind.DHT, config: BootstrapConfig) -> BootstrapMetrics | None:
    """Serve the node's metrics if `config.metrics_port` is set; `MetricsServerError` if it cannot."""
    if not config.metrics_port:
        return None

    def sample() -> tuple[int, dict[str, int]]:
        timeout_s = _METRICS_REFRESH_S
        rejected = dht_record_rejections(dht, timeout_s=timeout_s)
        for reason, count in dht_owned_rejections(dht, timeout_s=timeout_s).items():
            rejected[f"not owned: {reason}"] = count
        return num_known_peers(dht, timeout_s=timeout_s), rejected

    metrics = BootstrapMetrics()
    server = metrics.serve(port=config.metrics_port, host=config.metrics_host)
    metrics.start_refresh(sample, interval_s=min(config.refresh_period_s, _METRICS_REFRESH_S))
    logger.info("serving Prometheus metrics at %s", server.url)
    return metrics


def run(config: BootstrapConfig) -> int:
    """Run the bootstrap node until SIGINT/SIGTERM. Returns the exit code: 0, or 2 on bad input."""
    import uvloop

    # the first signal asks to stop; a second one is ignored: the clean-up below is bounded
    stop = StopSignal(second_interrupts=False).install()
    dht = None
    metrics = None
    try:
        if os.path.lexists(config.identity.expanduser()):
            check_identity_file(config.identity)  # fail on a bad identity before spawning anything
        start_reaper()
        # the bootstrap node stores records like any DHT node: it enforces owner-bound records and the
        # capability-record rules too
        dht = start_dht(
            config.initial_peers,
            host_maddrs=config.host_maddrs,
            announce_maddrs=config.announce_maddrs,
            identity_path=config.identity,
            connect_timeout_s=config.connect_timeout_s,
            nat_port_map=config.nat_port_map,
            record_validators=[PeerRecordValidator(), OwnerBoundValidator()],
            cancel=stop.event,
        )
        # after the DHT: its forked process would otherwise inherit the listening socket
        metrics = _start_metrics(dht, config)
        line = initial_peers_line(dht)
        print(line, flush=True)
        _print_banner(config, line, metrics.url if metrics is not None else None)
        uvloop.run(_serve(dht, config, stop))
        logger.info("%s, shutting down", stop.signal_name or "stopped")
    except (ValueError, DHTStartError) as error:
        return _fail(error)
    except TimeoutError as error:
        _fail(error)
        return 1
    except KeyboardInterrupt:  # the start-up wait was cancelled by the signal
        logger.info("%s while starting, shutting down", stop.signal_name)
    finally:
        stop.ignore()
        if metrics is not None:
            metrics.close(timeout_s=_METRICS_CLOSE_S)
        if dht is not None:
            stop_dht(dht)
        stop.restore()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m bootstrap`; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as error:
        return _fail(error)
    _configure_logging(config.log_level)
    return run(config)
