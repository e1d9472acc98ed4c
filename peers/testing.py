"""Realistic synthetic capability records, for tests and benchmarks (never used by a running peer)."""

from __future__ import annotations

import time

from bootstrap.identity import Identity
from bootstrap.records import Hardware, Network, PeerRecord, Performance, Requirements, RunInfo, Software, Trust

NO_REQUIREMENTS = Requirements(min_memory_bytes=0, dtype="fp32", min_swarm_version="", min_torch_version="")


def make_record(
    identity: Identity,
    *,
    run: str | None = "r",
    requirements: Requirements = NO_REQUIREMENTS,
    issued_at: int | None = None,
    lifetime_s: int = 45,
    seq: int = 1,
    samples_milli: int = 1000,
    task_preset: str = "tiny",
    digest: str = "d" * 64,
    state: str = "training",
) -> PeerRecord:
    issued_at = int(time.time()) if issued_at is None else issued_at
    hardware = Hardware(
        accelerator="cpu",
        name="test cpu",
        count=1,
        memory_total_bytes=2**34,
        memory_free_bytes=2**33,
        bf16=True,
        fp16=False,
        cpu_model="test cpu",
        cpu_cores=2,
        ram_total_bytes=2**34,
        ram_available_bytes=2**33,
    )
    run_info = (
        None
        if run is None
        else RunInfo(
            name=run,
            task="charlm",
            task_preset=task_preset,
            config_digest=digest,
            requirements=requirements,
            round=3,
            step=30,
        )
    )
    return PeerRecord(
        v=1,
        peer_id=identity.peer_id,
        public_key=identity.public_key.hex(),
        issued_at=issued_at,
        expires_at=issued_at + lifetime_s,
        seq=seq,
        state=state,
        run=run_info,
        hardware=hardware,
        software=Software(python="3.11", torch="2.13.0", cuda="none", hivemind="1.1.12", swarm="0.1.0"),
        perf=Performance(samples_per_s_milli=samples_milli, upload_kbps=None, download_kbps=None, rtt_us=None),
        network=Network(reachability="private", maddrs=("/ip4/127.0.0.1/tcp/1",), region=None),
        available_until=None,
        trust=Trust(uptime_s=10, rounds_completed=2, checkpoints_cosigned=0),
    )


def record_builder(identity: Identity, **fields):
    """An Advertiser ``build`` callback that publishes ``make_record(identity, **fields)`` on each heartbeat."""

    def build(*, issued_at: int, expires_at: int, seq: int) -> PeerRecord:
        return make_record(identity, issued_at=issued_at, lifetime_s=expires_at - issued_at, seq=seq, **fields)

    return build
