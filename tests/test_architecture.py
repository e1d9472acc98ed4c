"""The house's shape, checked: imports point down the floors, the trainer is a small composition root,
no class grows past 20 attributes, and one trainer process runs one event loop over one P2P replica.
"""

from __future__ import annotations

import ast
import asyncio
import gc
import os
import threading
from pathlib import Path

import pytest
import torch

from bootstrap.identity import Identity, IdentityError
from tests.helpers import parse_python

ROOT = Path(__file__).resolve().parents[1]
FLOORS = {"bootstrap": 1, "peers": 2, "averaging": 3, "swarm": 4}
"""Each package may import its own floor and the ones below, never one above."""
MAX_ATTRIBUTES = 20
MAX_TRAINER_LINES = 350


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _imported_packages(path: Path) -> set[str]:
    tree = parse_python(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & set(FLOORS)


def _attribute_count(cls: ast.ClassDef) -> int:
    """Distinct ``self.X`` assigned anywhere in the class, plus its annotated (dataclass) fields."""
    names = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    for node in ast.walk(cls):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, (ast.AnnAssign, ast.AugAssign))
            else []
        )
        for target in targets:
            for part in ast.walk(target):
                if isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name) and part.value.id == "self":
                    names.add(part.attr)
    return len(names)


def test_imports_point_down_the_floors() -> None:
    upward = [
        f"{path.relative_to(ROOT)} imports {name}"
        for package, floor in FLOORS.items()
        for path in _modules(package)
        for name in _imported_packages(path)
        if FLOORS[name] > floor
    ]
    assert upward == []


def test_an_upward_import_would_be_caught(tmp_path) -> None:
    module = tmp_path / "m.py"
    module.write_text("from swarm.trainer import Trainer\nimport peers.graph\n")
    assert _imported_packages(module) == {"swarm", "peers"}


def test_the_trainer_is_small_and_no_class_holds_more_than_20_attributes() -> None:
    assert len((ROOT / "swarm" / "trainer.py").read_text().splitlines()) <= MAX_TRAINER_LINES
    big = [
        f"{path.relative_to(ROOT)}:{node.name} ({_attribute_count(node)})"
        for package in ("swarm", "peers", "averaging", "bootstrap")
        for path in _modules(package)
        for node in ast.walk(parse_python(path.read_text()))
        if isinstance(node, ast.ClassDef) and _attribute_count(node) > MAX_ATTRIBUTES
    ]
    assert big == []
    crowded = ast.parse(
        "class C:\n    def __init__(self):\n" + "".join(f"        self.a{i} = {i}\n" for i in range(21))
    )
    assert _attribute_count(crowded.body[0]) == 21  # the count sees them


def _running_loops() -> list[asyncio.AbstractEventLoop]:
    return [o for o in gc.get_objects() if isinstance(o, asyncio.AbstractEventLoop) and o.is_running()]


def _live_replicas() -> list:
    from hivemind.p2p import P2P

    return [
        o
        for o in gc.get_objects()
        if isinstance(o, P2P) and getattr(o, "_alive", True) and getattr(o, "_client", None) is not None
    ]


@pytest.mark.timeout(120)
def test_one_trainer_process_runs_one_event_loop_over_one_p2p_replica(tmp_path) -> None:
    from bootstrap.runtime import NetworkRuntime
    from swarm.trainer import Trainer

    threads_before = set(threading.enumerate())
    assert NetworkRuntime.count() == 0 and _running_loops() == []
    model = torch.nn.Linear(4, 2)
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        run="one-loop",
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        checkpoint_dir=str(tmp_path / "ck"),
        ledger_dir=str(tmp_path / "ledgers"),
        matchmaking_time_s=0.3,
        join_timeout_s=0.5,
        round_timeout_s=5.0,
        bandwidth_probe_period_s=1.0,
        load_state=False,
    )
    try:
        # every network part is up: averager, gossip, shard exchange, bandwidth prober, advertiser, status
        assert trainer.group_averager is not None and trainer.checkpoints is not None
        assert trainer.presence.prober is not None and trainer.presence.status is not None
        result = trainer.sync()  # a (solo) round used the averager's handler and client calls
        assert result.group_size == 1
        assert NetworkRuntime.count() == 1
        loops = _running_loops()
        assert len(loops) == 1, loops
        assert len(_live_replicas()) == 1
        names = sorted(t.name for t in set(threading.enumerate()) - threads_before)
        assert names.count("swarm-network") == 1, names
        # no identity given: swarm.peer's persistent default key, held by this live peer alone
        assert trainer.identity.path == Path.home() / ".swarm" / "identity.key"
        with pytest.raises(IdentityError, match=r"in use by another running peer.*identity_key="):
            Identity.load_or_create().lock()
    finally:
        trainer.shutdown()
    assert NetworkRuntime.count() == 0
    again = Identity.load_or_create()  # released at shutdown: the next peer of this process is the same peer
    again.lock()
    again.unlock()
    assert again.peer_id == trainer.identity.peer_id
    from tests.helpers import wait_until

    def ours_left() -> list[str]:  # hivemind's and multiprocessing's process-wide helper threads stay, by design
        return [t.name for t in set(threading.enumerate()) - threads_before if t.name.startswith("swarm")]

    wait_until(lambda: not ours_left(), 10.0, message=lambda: f"no thread of ours left (left: {ours_left()})")


def test_the_suite_runs_one_torch_thread_a_process_unless_told_otherwise() -> None:
    """`make test`'s time budget rests on tests/conftest.py's default: one torch thread in each worker and in
    every process it starts (the variable is inherited), so dozens of processes do not oversubscribe the
    cores."""
    threads = os.environ.get("OMP_NUM_THREADS")
    assert threads is not None and threads.isdigit(), threads
    assert torch.get_num_threads() == int(threads)
