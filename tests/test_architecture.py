"""The house's shape, checked: imports point down the floors, the trainer is a small composition root,
no class grows past 20 attributes, and one trainer process runs one event loop over one P2P replica.
"""

from __future__ import annotations

import ast
import asyncio
import gc
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from bootstrap._private.deferred import defer_unused_imports
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


def test_a_peer_starts_without_the_scipy_optimize_hivemind_imports_and_loads_it_on_first_use() -> None:
    """hivemind's package imports `scipy.optimize` (DecentralizedAverager's load balancing), which no Swarm
    process uses: 0.28 s of wall time and 36 MiB of every process's start here (`farm-bench`, importing
    swarm.peer). Importing any Swarm package first defers it; its first use loads it, and the watchdog
    imports neither scipy nor numpy."""
    code = (
        "import sys; import swarm.peer; print(type(sys.modules['scipy.optimize']).__name__); "
        "from hivemind.averaging.load_balancing import load_balance_peers; parts = load_balance_peers(100, [1.0, 3.0, None]); "
        "from scipy.optimize import linprog; print(type(sys.modules['scipy.optimize']).__name__, callable(linprog)); "
        "print(sum(parts), min(parts) >= 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == ["_Deferred", "module True", "100 True"], done.stdout
    watchdog = "import sys, bootstrap.lifetime; print('scipy' in sys.modules, 'numpy' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", watchdog], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == "False False", (done.stdout, done.stderr)


def test_a_deferred_module_loads_on_its_first_attribute_and_stale_references_forward_to_it(
    tmp_path, monkeypatch
) -> None:
    package = tmp_path / "deferpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "heavy.py").write_text(
        "import sys\nsys.modules['deferpkg'].loads = getattr(sys.modules['deferpkg'], 'loads', 0) + 1\nVALUE = 42\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("deferpkg", "deferpkg.heavy"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert defer_unused_imports(("deferpkg.heavy", "deferpkg.missing", "not_a_package_here.x")) == ["deferpkg.heavy"]
    assert "deferpkg" not in sys.modules  # nothing imported to find it
    import deferpkg.heavy as stand_in  # the import statement reads only what the stand-in holds

    assert getattr(sys.modules["deferpkg"], "loads", 0) == 0
    assert stand_in.VALUE == 42 and sys.modules["deferpkg"].loads == 1
    real = sys.modules["deferpkg.heavy"]
    assert real is not stand_in and real.VALUE == 42 and stand_in.VALUE == 42  # the stand-in forwards
    assert sys.modules["deferpkg"].loads == 1  # loaded once
    assert "VALUE" in dir(stand_in)  # what `dir`, `help` and `inspect` list of a stale reference
    assert defer_unused_imports(("deferpkg.heavy",)) == []  # imported already: left as it is
