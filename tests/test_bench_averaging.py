"""benchmarks.averaging_round: the result check catches a wrong mean, and a tiny run (2 worker
processes per method on loopback) passes it and writes the documented JSON. Times are not asserted:
benchmarks measure, tests check correctness."""

from __future__ import annotations

import json

import pytest
import torch

from averaging import get_codec
from averaging.group import slice_bounds
from benchmarks import averaging_round
from benchmarks._avg_worker import checksum, make_tensor, sample_indices

TOP_KEYS = {
    "benchmark",
    "date",
    "machine",
    "cpus",
    "python",
    "torch",
    "hivemind",
    "command",
    "config",
    "elapsed_s",
    "ok",
    "rows",
    "skipped",
    "sender_death",
}
ROW_KEYS = {
    "setting",
    "rate_mbit",
    "peers",
    "numel",
    "payload_bytes",
    "method",
    "codec",
    "round_s",
    "median_s",
    "min_s",
    "floor_s",
    "floor_wire_s",
    "over_floor",
    "over_hivemind",
    "over_gloo",
    "tx_bytes_per_peer",
    "rx_bytes_per_peer",
    "app_bytes_sent_per_peer",
    "check_ok",
    "check",
    "error",
    "warmup_round_s",
    "warmup",
    "repeats",
}


def _exact_mean(numel: int, num_peers: int) -> torch.Tensor:
    return torch.stack([make_tensor(averaging_round.SEED, r, numel) for r in range(num_peers)]).double().mean(0)


@pytest.mark.timeout(30)
def test_check_accepts_the_mean_within_codec_bounds_and_rejects_a_wrong_value() -> None:
    numel, num_peers = 50_000, 3
    mean = _exact_mean(numel, num_peers).float()
    fp32 = averaging_round.reference(numel, tuple(range(num_peers)), num_peers, "fp32")
    assert averaging_round.check([{"rank": 0, "outcome": "ok", "checksum": checksum(mean)}], fp32)["ok"]

    wrong = mean.clone()
    wrong[sample_indices(numel)[7]] += 1e-3  # far above 1e-5 relative, far below what a plot would show
    assert not averaging_round.check([{"rank": 0, "outcome": "ok", "checksum": checksum(wrong)}], fp32)["ok"]

    # int8: the result as a member receives it (each slice encoded on its own) is within the bound...
    codec = get_codec("int8")
    received = torch.cat(
        [codec.decode(codec.encode(mean[a:b].contiguous()), numel=b - a) for a, b in slice_bounds(numel, num_peers)]
    )
    int8 = averaging_round.reference(numel, tuple(range(num_peers)), num_peers, "int8")
    assert averaging_round.check([{"rank": 0, "outcome": "ok", "checksum": checksum(received)}], int8)["ok"]
    # ...but the mean of the wrong peers is not
    others = _exact_mean(numel, num_peers + 1).float()
    assert not averaging_round.check([{"rank": 0, "outcome": "ok", "checksum": checksum(others)}], int8)["ok"]


@pytest.mark.timeout(90)
@pytest.mark.heavy(seconds=15)
def test_tiny_run_passes_its_result_checks_and_writes_the_documented_json(tmp_path) -> None:
    out = tmp_path / "averaging_round.json"
    code = averaging_round.main(
        [
            "--peers",
            "2",
            "--numel",
            "200000",
            "--settings",
            "loopback",
            "--repeats",
            "1",
            "--methods",
            "ours-fp32",
            "gloo",
            "hivemind",
            "--out",
            str(out),
        ]
    )
    result = json.loads(out.read_text())
    assert code == 0, [(r["method"], r["error"], r["check"]) for r in result["rows"]]
    assert TOP_KEYS <= set(result)
    assert result["ok"] and result["skipped"] == [] and result["sender_death"] == []
    assert [r["method"] for r in result["rows"]] == ["ours-fp32", "gloo", "hivemind"]
    for row in result["rows"]:
        assert ROW_KEYS <= set(row), ROW_KEYS - set(row)
        assert row["check_ok"] and row["error"] is None
        assert len(row["round_s"]) == 1 and row["median_s"] > 0
        assert row["floor_s"] is None  # loopback: no link rate, no floor
        # every peer's result was checked against the reference mean, in the warm-up round too
        for repeat in row["warmup"] + row["repeats"]:
            assert repeat["check"]["ok"] and sum(repeat["check"]["outcomes"].values()) == 2
    ours = result["rows"][0]
    assert ours["over_hivemind"] > 0 and ours["over_gloo"] > 0
