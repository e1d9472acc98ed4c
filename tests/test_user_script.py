"""A user's own script on `swarm.Trainer` (own model and data, the README's pattern), as 3 processes with
persistent identities: a restart is the same peer and resumes with the run's state (its batch norm's statistics
included), Ctrl+C and SIGTERM are a clean leave, and the others' next round is not slowed by a member that leaves."""

from __future__ import annotations

import json
import os
import signal
import statistics
import time
from pathlib import Path

import pytest

from swarm.ledger import find_ledgers, read_entries
from tests.helpers import Child, python_cmd, read_line_matching, spawn, terminate_all, wait_until

USER_SCRIPT = """
import json, sys, time, torch, swarm

key, ledgers, checkpoints, *initial_peers = sys.argv[1:]
torch.manual_seed(0)  # every member builds the same model
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
truth = torch.randn(8, 1, generator=torch.Generator().manual_seed(1))
data = torch.Generator().manual_seed(abs(hash(key)) % 2**31)  # its own data
with swarm.Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), run="users-own", identity_key=key,
                   initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], ledger_dir=ledgers,
                   checkpoint_dir=checkpoints, sync_every=20, target_group_size=3, round_timeout_s=10.0,
                   load_state_timeout_s=10.0) as trainer:
    print("PEER", trainer.peer_id, flush=True)
    print("STATS", float(model[1].running_mean.abs().sum()), flush=True)  # 0 until trained, or loaded from a seal
    while True:
        x = torch.randn(16, 8, generator=data)
        loss = (model(x) - x @ truth).pow(2).mean()
        loss.backward()
        result = trainer.step(num_samples=len(x), loss=loss.item())
        if result is not None:
            record = result.record.to_dict() if result.record is not None else {}
            line = {"t": time.time(), "round": result.round, "group": result.group_size, "s": result.duration_s,
                    "phases": record.get("phase_s"), "failures": record.get("failures")}
            print("ROUND", json.dumps(line), flush=True)
        time.sleep(0.02)  # a user's data loading; keeps 3 processes from starving the rest of 2 cores
print("AFTER THE BLOCK", flush=True)
"""

SLOWDOWN_BOUND_S = 1.0


def _rounds(child: Child) -> list[dict]:
    return [json.loads(line.split(" ", 1)[1]) for line in child.stdout_lines if line.startswith("ROUND ")]


def _grouped(child: Child, size: int) -> int:
    return sum(r["group"] == size for r in _rounds(child))


@pytest.mark.timeout(240)
@pytest.mark.heavy(seconds=40, timed=True)
def test_three_processes_of_a_users_script_restart_ctrl_c_and_sigterm(bootstrap_node, tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text(USER_SCRIPT)

    def start(name: str) -> Child:
        args = [str(tmp_path / f"{name}.key"), str(tmp_path / name), str(tmp_path / f"{name}-ck"), *bootstrap_node]
        return spawn(python_cmd(str(script), *args))

    def leave(child: Child, sig: signal.Signals, name: str, others: list[Child]) -> None:
        """Signal ``child``; it leaves cleanly within 5 s, and the others' next round is not slowed."""
        before = {id(o): len(_rounds(o)) for o in others}
        typical = statistics.median(r["s"] for o in others for r in _rounds(o)[-4:] if r["group"] == 3)
        os.kill(child.pid, sig)
        began = time.monotonic()
        wait_until(lambda: child.returncode is not None, timeout_s=10, message=child.describe)
        took = time.monotonic() - began
        child.join_output()
        assert took < 5.0 and child.returncode == 0, (took, child.describe())
        assert "AFTER THE BLOCK" in child.stdout() and "Traceback" not in child.stderr(), child.describe()
        assert f"stopped by {sig.name}: left the run cleanly" in " ".join(child.stderr().split()), child.describe()
        (ledger,) = find_ledgers(tmp_path / name)
        last = read_entries(Path(ledger))[-1]
        assert last.kind == "stop" and last.body["signal"] == sig.name, last
        for other in others:  # the round in flight when it left, or the next one
            wait_until(lambda o=other: len(_rounds(o)) > before[id(o)], timeout_s=30, message=other.describe)
        for other in others:
            nxt = _rounds(other)[before[id(other)]]
            assert nxt["s"] <= typical + SLOWDOWN_BOUND_S, (sig.name, nxt, typical, other.describe())

    names = ["a", "b", "c"]
    children = {name: start(name) for name in names}
    try:
        ids = {name: read_line_matching(c, r"^PEER (\S+)$", timeout_s=60).group(1) for name, c in children.items()}
        for child in children.values():
            wait_until(lambda c=child: _grouped(c, 3) >= 3, timeout_s=90, message=child.describe)

        leave(children["a"], signal.SIGINT, "a", [children["b"], children["c"]])  # Ctrl+C
        children["a"] = start("a")  # the restart: the same key, the same peer of the run
        assert read_line_matching(children["a"], r"^PEER (\S+)$", timeout_s=60).group(1) == ids["a"]
        # it resumed from a sealed checkpoint, its model's batch norm statistics included (before stop 62 only the
        # parameters were sealed, and a restart or joiner began with a fresh model's zeros)
        assert float(read_line_matching(children["a"], r"^STATS (\S+)$", timeout_s=10).group(1)) > 0
        since = {name: _grouped(child, 3) for name, child in children.items()}
        for name, child in children.items():  # all three together again, settled
            wait_until(lambda c=child, n=since[name]: _grouped(c, 3) >= n + 3, timeout_s=90, message=child.describe)

        leave(children["b"], signal.SIGTERM, "b", [children["a"], children["c"]])
    finally:
        terminate_all(list(children.values()), timeout_s=10)
