"""TESTMATRIX row 9, small and seeded: benchmarks.byzantine trains charlm with 4 in-process trainers
(real GroupAverager rounds over loopback P2P), one of which sends -10 x its update every round.

One run (module fixture: clean, attacked with the default CenteredClip, attacked with the plain mean)
feeds two tests: the attack fired and the negative control broke; and the default robust aggregator
bounding the damage. CenteredClip (radius 3x the median distance) limits the attacker's pull each round
but does not remove it, and the outer momentum adds it up: measured 1.23-1.32x the clean val loss after
6 rounds (trimmed mean 1.05x, plain mean 49x). The benchmark reports that as a miss of its 1.10x target;
this test guards the bound, so that a weaker rule cannot slip in.
"""

import math

import pytest
import torch
from rich.console import Console

from averaging.compression import get_codec
from benchmarks.byzantine import CLIPPED_PULL, CONTROL_FACTOR, ByzantineConfig, encode_as_is, run

SEED = 0
ROBUST_BOUND = 1.5
"""CenteredClip's val loss under attack, as a multiple of the clean run's (see the module docstring)."""
CONFIG = ByzantineConfig(
    peers=4, rounds=4, sync_every=8, attack="sign_flip_x10", aggregators=("centered_clip", "mean"), seed=SEED
)


@pytest.fixture(scope="module")
def arms():
    result = run(CONFIG, Console(quiet=True))
    return {arm["arm"]: arm for arm in result["arms"]}


def _context(arms):
    return f"seed {SEED}: " + ", ".join(f"{name} {arm['final_val_loss']}" for name, arm in arms.items())


@pytest.mark.timeout(240)
def test_the_attack_fires_every_round_and_breaks_the_plain_mean(arms):
    clean, robust, mean = arms["clean"], arms["sign_flip_x10/centered_clip"], arms["sign_flip_x10/mean"]
    assert clean["final_val_loss"] < 0.9 * clean["initial_val_loss"], "the clean run must learn; " + _context(arms)
    for arm in (robust, mean):
        assert arm["rounds_poisoned"] == CONFIG.rounds, arm
        # every round the attacker was in a group, it sent one poisoned part to each other member
        assert arm["attacked_rounds"] >= 1, arm
        assert arm["parts_sent_poisoned"] >= (CONFIG.peers - 1) * arm["attacked_rounds"], arm
        assert arm["parts_sent_poisoned"] <= (CONFIG.peers - 1) * CONFIG.rounds, arm
    assert robust["clipped"] == robust["attacked_rounds"] and robust["mean_pull"] < CLIPPED_PULL, robust
    assert mean["passed"] == mean["attacked_rounds"], mean
    assert not mean["final_finite"] or mean["final_val_loss"] >= CONTROL_FACTOR * clean["final_val_loss"], (
        "the negative control must fail; " + _context(arms)
    )


@pytest.mark.timeout(240)
def test_the_default_robust_aggregator_bounds_the_damage(arms):
    clean, robust = arms["clean"], arms["sign_flip_x10/centered_clip"]
    assert robust["final_finite"], _context(arms)
    ratio = robust["final_val_loss"] / clean["final_val_loss"]
    assert ratio <= ROBUST_BOUND, (
        f"CenteredClip ended at {ratio:.2f}x the clean val loss (pull {robust['mean_pull']:.2f}); " + _context(arms)
    )


@pytest.mark.parametrize("codec", ["fp32", "fp16", "int8"])
def test_the_nan_attackers_bytes_have_the_wire_size_and_are_refused_at_decode(codec):
    """The nan arm's attacker really puts NaN on the wire; every reducer's decoder refuses it."""
    vector = torch.randn(9000, generator=torch.Generator().manual_seed(SEED))
    vector[4500] = math.nan
    real = get_codec(codec)
    data = encode_as_is(real, vector)
    assert len(data) == real.wire_bytes(vector.numel())
    with pytest.raises(ValueError, match="nan"):
        real.decode(data, numel=vector.numel())
