"""Averaging: bounded groups that re-form on churn, butterfly all-reduce, 8-bit transfers, robust slices.

Policy (see averaging.group for the protocol):
  * groups of min_group_size..target_group_size form through the DHT with no coordinator; peers are
    ordered by bandwidth class (peers of a similar class average together, so a slow peer does not
    drag a fast group down), then by a hash salted with the candidate list, so membership reshuffles
    every round and updates mix across the swarm (Moshpit-style); a run of more than shard_size (64)
    live members looks on several keys, drawn anew each minute, so no DHT node serves a whole run;
  * on an open network (with the peer's identity) matchmaking entries are owner-signed and only live
    members of the run are drawn; no-shows are suspects for a while (averaging.membership);
  * every part is validated (shape, codec, finite values, weight finite and within bounds) and ends with
    its sender's signed statement of it (PartStatement: what a verifier holds the sender to); each
    slice is aggregated with CenteredClip by default (trimmed mean or plain mean selectable);
  * a sender silent past its deadline is dropped and the survivors average exactly the surviving
    contributions (reducers agree on the survivor set); a lost slice re-forms the group from the
    survivors and retries within the round's deadline; every outcome is in a RoundRecord.

Owns: AveragingConfig, RoundRecord, GroupAverager, the codecs (fp32, fp16, bitsandbytes int8) and the
aggregators. Uses the ground floor (bootstrap: framing, signatures, the network runtime), hivemind's DHT, torch and
bitsandbytes; knows nothing of the peer process.
"""

from averaging.aggregation import AGGREGATOR_NAMES, AggregationResult, Contribution, aggregate, get_aggregator
from averaging.compression import CODEC_NAMES, get_codec, wire_bytes
from averaging.config import AveragingConfig, RoundRecord
from averaging.faults import Crashed, FaultInjector
from averaging.group import Group, GroupAverager, draw_groups

__all__ = [
    "AGGREGATOR_NAMES",
    "CODEC_NAMES",
    "AggregationResult",
    "AveragingConfig",
    "Contribution",
    "Crashed",
    "FaultInjector",
    "Group",
    "GroupAverager",
    "RoundRecord",
    "aggregate",
    "draw_groups",
    "get_aggregator",
    "get_codec",
    "wire_bytes",
]
