"""Every command-line entry point: --help works, the option set is frozen, bad input fails clearly."""

import importlib
import os
import signal
import socket
import stat
import subprocess
import sys
import time

import psutil
import pytest

from bootstrap.cli import dataclass_flags
from swarm.peer import PeerConfig, build_parser
from swarm.peer import main as peer_main
from swarm.trainer import TrainerConfig
from tests.helpers import free_port, p2pd_pids, python_cmd, spawn, wait_until

# Adding, renaming or removing a flag is a decision: update this list in the same change.
PEER_FLAGS = [
    "--run",
    "--initial-peers",
    "--sync-every",
    "--overlap",
    "--overlap-eager",
    "--inner-warmup-steps",
    "--outer-lr",
    "--outer-momentum",
    "--divergence-rounds",
    "--load-state",
    "--load-state-timeout-s",
    "--min-group-size",
    "--target-group-size",
    "--matchmaking-time-s",
    "--join-timeout-s",
    "--sender-timeout-s",
    "--reducer-timeout-s",
    "--agreement-timeout-s",
    "--round-timeout-s",
    "--members-only",
    "--suspect-s",
    "--guard-s",
    "--shard-size",
    "--piece-numel",
    "--max-attempts",
    "--codec",
    "--aggregator",
    "--max-weight",
    "--max-weight-ratio",
    "--host-maddrs",
    "--announce-maddrs",
    "--connect-timeout-s",
    "--dht-rpc-timeout-s",
    "--checkpoint-dir",
    "--checkpoint-every",
    "--keep-checkpoints",
    "--ledger-dir",
    "--advertise",
    "--record-refresh-s",
    "--record-expiry-s",
    "--bandwidth-probe-period-s",
    "--region",
    "--available-until",
    "--require-memory-gb",
    "--require-dtype",
    "--require-swarm-version",
    "--require-torch-version",
    "--metrics-port",
    "--metrics-host",
    "--progress",
    "--verify-work",
    "--check-rate",
    "--trusted-rate",
    "--trust-after",
    "--segment-steps",
    "--require-verified",
    "--replay-nice",
    "--task",
    "--task-preset",
    "--device",
    "--precision",
    "--optimizer",
    "--lr",
    "--weight-decay",
    "--num-shards",
    "--shard-index",
    "--seed",
    "--max-steps",
    "--max-rounds",
    "--duration-s",
    "--eval-batches",
    "--eval-every",
    "--torch-threads",
    "--identity-key",
    "--events",
    "--dump-dir",
]


def test_peer_flags_are_frozen_and_map_onto_config_fields():
    assert dataclass_flags(TrainerConfig) + dataclass_flags(PeerConfig) == PEER_FLAGS
    parser_flags = {s for a in build_parser()._actions for s in a.option_strings if s.startswith("--")}
    assert parser_flags == set(PEER_FLAGS) | {
        "--help",
        "--log-level",
        "--no-load-state",
        "--no-overlap",
        "--no-overlap-eager",
        "--no-progress",
        "--no-advertise",
        "--no-members-only",
        "--no-verify-work",
        "--no-require-verified",
        "--averaging-timeout-s",
    }  # the last: renamed, kept


@pytest.mark.parametrize("module", ["bootstrap", "swarm.peer"])
def test_help_of_the_entry_points(module):
    """The README's two entry points, as a user starts them (``python -m``)."""
    child = spawn(python_cmd("-m", module, "--help"))
    wait_until(lambda: child.returncode is not None, timeout_s=60, message=child.describe)
    child.join_output()
    assert child.returncode == 0, child.describe()
    assert "usage:" in child.stdout()


@pytest.mark.parametrize(
    "module",
    [
        "bootstrap.node",
        "swarm.peer",
        "swarm.demo",
        "peers.__main__",
        "swarm.checkpoint.__main__",
        "swarm.ledger.__main__",
        "swarm.status",
        "swarm.report",
    ],
)
def test_help(module, capsys):
    """Every CLI's ``main(["--help"])``, in this process (``python -m X`` runs ``sys.exit(main())``)."""
    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(module).main(["--help"])
    assert exit_info.value.code == 0
    assert "usage:" in capsys.readouterr().out


def _run_peer(*args: str, timeout_s: float = 60):
    child = spawn(python_cmd("-m", "swarm.peer", "--no-progress", *args))
    started = time.monotonic()
    wait_until(lambda: child.returncode is not None, timeout_s=timeout_s, message=child.describe)
    child.join_output()
    return child, time.monotonic() - started


def _peer_main(capsys, *args: str) -> tuple[int, str]:
    """``swarm.peer``'s ``main`` in this process, for input it must refuse before it starts anything
    (no DHT, no signal handler, no file); returns the exit code and what it wrote to stderr."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    code = peer_main(["--no-progress", *args])
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers, "refused input installed a signal handler"
    return code, " ".join(capsys.readouterr().err.split())


def test_malformed_initial_peer_is_named_and_exits_2(tmp_path, capsys):
    code, err = _peer_main(
        capsys, "--run", "x", "--identity-key", str(tmp_path / "k"), "--initial-peers", "/ip4/1.2.3/tcp/x"
    )
    assert code == 2, err
    assert "/ip4/1.2.3/tcp/x" in err


_NOBODY = "QmVekjsvS68BRG1RfmybbEmgNmt8Yk1Anpan5uqYmkmczq"
"""A well-formed peer ID no test process has."""


def test_unreachable_initial_peer_is_named_within_the_timeout(tmp_path):
    addr = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{_NOBODY}"
    child, elapsed_s = _run_peer(
        "--run",
        "x",
        "--identity-key",
        str(tmp_path / "k"),
        "--initial-peers",
        addr,
        "--host-maddrs",
        "/ip4/127.0.0.1/tcp/0",
        "--connect-timeout-s",
        "10",
    )
    assert child.returncode == 2, child.describe()
    assert addr in " ".join(child.stderr().split()), child.describe()
    assert elapsed_s < 30


def test_sigterm_while_the_dht_dials_its_initial_peer_is_a_clean_stop(tmp_path):
    """SIGTERM while `swarm.peer` still dials its initial peer (a listener that accepts TCP and never speaks
    libp2p keeps hivemind dialling for ~5 s): it stops at once, exits 0 and takes its p2pd with it. Before, the
    DHT's start could not be cancelled: the peer dialled on and exited 2, "cannot reach bootstrap peers"."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        addr = f"/ip4/127.0.0.1/tcp/{listener.getsockname()[1]}/p2p/{_NOBODY}"
        args = ["--run", "x", "--identity-key", str(tmp_path / "k"), "--initial-peers", addr]
        args += ["--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--connect-timeout-s", "60"]
        child = spawn(python_cmd("-m", "swarm.peer", "--no-progress", *args))
        try:
            wait_until(lambda: p2pd_pids(child.pid), timeout_s=60, message=child.describe)  # it is dialling
            daemons = p2pd_pids(child.pid)
            signalled = time.monotonic()
            child.popen.send_signal(signal.SIGTERM)
            wait_until(lambda: child.returncode is not None, timeout_s=30, message=child.describe)
            stopped_s = time.monotonic() - signalled
        finally:
            if child.returncode is None:
                child.popen.kill()
        child.join_output()
    assert child.returncode == 0, child.describe()
    assert "stopped while starting" in child.stderr(), child.describe()
    assert stopped_s < 5.0, f"stopped {stopped_s:.1f} s after SIGTERM"
    wait_until(lambda: not [pid for pid in daemons if psutil.pid_exists(pid)], timeout_s=5, message="p2pd gone")


def test_unknown_task_lists_known_tasks(tmp_path, capsys):
    code, err = _peer_main(capsys, "--run", "x", "--task", "nope", "--identity-key", str(tmp_path / "k"))
    assert code == 2, err
    assert "known tasks: charlm" in err
    assert not (tmp_path / "k").exists(), "a failed start must not create files"


@pytest.mark.parametrize("problem", ["corrupt", "unsafe"])
def test_bad_identity_key_is_refused_and_left_alone(tmp_path, problem, capsys):
    key = tmp_path / "identity.key"
    key.write_bytes(b"not a key" if problem == "corrupt" else b"swarm-ed25519-v1\n" + b"ab" * 32 + b"\n")
    os.chmod(key, 0o600 if problem == "corrupt" else 0o644)
    before = key.read_bytes()
    code, err = _peer_main(capsys, "--run", "x", "--identity-key", str(key))
    assert code == 2, err
    assert str(key) in err
    assert key.read_bytes() == before
    assert stat.S_IMODE(key.stat().st_mode) == (0o600 if problem == "corrupt" else 0o644)


def test_port_in_use_is_a_clear_error(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        child, _ = _run_peer(
            "--run",
            "x",
            "--identity-key",
            str(tmp_path / "k"),
            "--host-maddrs",
            f"/ip4/127.0.0.1/tcp/{port}",
            "--connect-timeout-s",
            "15",
        )
    assert child.returncode == 2, child.describe()
    assert str(port) in child.stderr()


def test_bad_config_value_names_the_field(tmp_path, capsys):
    code, err = _peer_main(capsys, "--run", "x", "--sync-every", "0", "--identity-key", str(tmp_path / "k"))
    assert code == 2, err
    assert "sync_every" in err


def test_an_error_in_a_renamed_field_names_it_as_the_user_typed_it():
    with pytest.warns(DeprecationWarning, match="averaging_timeout_s is now round_timeout_s"):
        with pytest.raises(ValueError, match=r"^averaging_timeout_s \(now round_timeout_s\) \(5\) must exceed"):
            TrainerConfig.create(run="r", averaging_timeout_s=5)


def test_logs_to_a_file_or_pipe_are_plain_one_line_records():
    """Written to a file, a long record (a peer ID and a multiaddr) stays on one line with its level and
    logger: rich's handler would wrap it at 80 columns. swarm.peer and the bootstrap node both use it."""
    code = (
        "import logging; from bootstrap.cli import log_handler; "
        "logging.basicConfig(level='INFO', handlers=[log_handler()]); "
        "logging.getLogger('swarm.peer').info('joined run r via /ip4/127.0.0.1/tcp/31337/p2p/' + 'Qm' + 'x' * 44 "
        "+ ' as peer ' + 'Qm' + 'y' * 44)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and len(lines[0]) > 160, done.stderr
    assert " INFO swarm.peer: joined run r via /ip4/127.0.0.1/tcp/31337/p2p/Qm" in lines[0]
