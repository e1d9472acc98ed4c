"""Swarm: peer-to-peer training on an open network, with no central coordinator.

Owns the contributing peer process (`python -m swarm.peer`; several processes under torchrun as one
peer: `swarm.node`), the trainer API for users' own
scripts (`swarm.Trainer`, a composition root over its parts: the nested `swarm.config.TrainerConfig`,
the DiLoCo outer optimizer `swarm.outer`, one round `swarm.round_runner` (blocking, or in the
background as `swarm.overlap` defines), the round's pure bookkeeping `swarm.rounds`, presence in the
run `swarm.presence`; `swarm.Identity` is `bootstrap.identity.Identity`), the built-in task
registry (`swarm.tasks`), sealed checkpoints (`swarm.checkpoint`: store, signed manifests, gossip,
verified shard exchange, state sync), the evidence of a run (`swarm.ledger`: hash-chained signed
ledgers and participation receipts; `swarm.status`: the live board; `swarm.report`: the HTML report;
`swarm.metrics`: Prometheus), verified work (`swarm.verify`: phase commitments and their replay;
`swarm.work`: checks, verdicts and exclusion in a trainer; `swarm.replayer`: replays in a process of
their own for tasks that draw random numbers) and the one-command demo (`python -m swarm.demo`).

Composes the other packages: `bootstrap` (the ground floor: DHT start-up, identity and signatures,
capability records, process lifetime), `peers` (probes, advertiser, resource graph) and `averaging`
(groups, robust all-reduce), over hivemind's DHT and the ground floor's one network runtime per process.
Exports: Trainer, TrainerConfig, RoundResult, Identity, ScaledStep (imported lazily: `import swarm` stays cheap).
"""

from __future__ import annotations

from typing import Any

from bootstrap.version import SWARM_VERSION

__all__ = ["Identity", "RoundResult", "RunMismatch", "ScaledStep", "TaskInfo", "Trainer", "TrainerConfig"]
__version__ = SWARM_VERSION

_LAZY = {
    "Trainer": "swarm.trainer",
    "TrainerConfig": "swarm.config",
    "RoundResult": "swarm.rounds",
    "TaskInfo": "swarm.config",
    "RunMismatch": "swarm.config",
    "Identity": "bootstrap.identity",
    "ScaledStep": "swarm.recipe",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'swarm' has no attribute {name!r}")
