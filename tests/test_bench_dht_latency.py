"""`benchmarks.dht_latency`'s pure part: pings split into those sent during a round and the rest."""

from __future__ import annotations

from benchmarks.dht_latency import summarize


def test_pings_are_split_by_the_rounds_they_were_sent_in_and_counted_over_each_threshold() -> None:
    result = {
        "rounds": [(10.0, 20.0, "ok"), (30.0, 40.0, "ok")],
        "pings": [(5.0, 0.002, True), (12.0, 0.5, True), (15.0, 2.5, True), (25.0, 0.003, True), (35.0, 3.5, False)],
    }
    row = summarize(result)
    assert row["round_s"] == [10.0, 10.0] and row["outcomes"] == ["ok", "ok"]
    during, quiet = row["during_rounds"], row["quiet"]
    assert during["pings"] == 3 and during["failed"] == 1 and during["max_s"] == 3.5
    assert (during["over_1s"], during["over_2s"], during["over_3s"]) == (2, 2, 1)
    assert quiet["pings"] == 2 and quiet["failed"] == 0 and quiet["max_s"] == 0.003
    assert summarize({"rounds": [], "pings": []})["during_rounds"] == {"pings": 0, "failed": 0}
