"""One conformance suite for every aggregator in `averaging.aggregation`, plus TESTMATRIX rows 9-10.

Every aggregator: identical inputs come back bit for bit; close honest inputs give the weighted
mean (mean: 1e-6 relative; every rule for n < 3) or stay within the honest spread and near the mean
(trimmed_mean, and centered_clip, whose radius of one median distance clips some honest inputs); `aggregate` rejects every poisoned contribution with a reason and
leaves the result exactly as if it had never been sent. Row 9 has its negative control: the plain
mean must be hurt by each attack, or the attack did not fire. Every random input comes from a
seeded generator, and assertion messages name the seed.
"""

from __future__ import annotations

import math

import pytest
import torch

from averaging.aggregation import (
    AGGREGATOR_NAMES,
    Aggregator,
    CenteredClip,
    Contribution,
    Mean,
    TrimmedMean,
    _coordinate_median,
    aggregate,
    get_aggregator,
    validate_contribution,
)

AGGREGATORS: list[Aggregator] = [get_aggregator(name) for name in AGGREGATOR_NAMES]
EXACT_ON_HONEST = {"mean"}
ROBUST = ("trimmed_mean", "centered_clip")
NUMEL = 2000


@pytest.fixture(params=AGGREGATORS, ids=AGGREGATOR_NAMES)
def aggregator(request: pytest.FixtureRequest) -> Aggregator:
    return request.param


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _honest(num: int, *, seed: int, numel: int = NUMEL, spread: float = 0.01, scale: float = 1.0):
    """`num` contributions ~ N(mu, spread) * scale with weights 1..num; and mu."""
    generator = _generator(seed)
    mu = torch.randn(numel, generator=generator, dtype=torch.float64)
    contributions = [
        Contribution(
            sender=f"honest-{i}",
            tensor=((mu + spread * torch.randn(numel, generator=generator, dtype=torch.float64)) * scale).float(),
            weight=float(i + 1),
        )
        for i in range(num)
    ]
    return contributions, mu


def _reference_mean(contributions: list[Contribution]) -> torch.Tensor:
    total = sum(c.weight * c.tensor.double() for c in contributions)
    return total / sum(c.weight for c in contributions)


def _relative_error(result: torch.Tensor, reference: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(result.double() - reference) / torch.linalg.vector_norm(reference))


# --- conformance ----------------------------------------------------------------------------------


@pytest.mark.parametrize("num", [1, 2, 3, 4, 7])
def test_identical_inputs_come_back_exactly(aggregator: Aggregator, num: int) -> None:
    seed = 100 + num
    x = torch.randn(NUMEL, generator=_generator(seed)) * 1e3
    weights = torch.rand(num, generator=_generator(seed + 1)) * 10 + 0.01
    contributions = [Contribution(sender=f"p{i}", tensor=x.clone(), weight=float(w)) for i, w in enumerate(weights)]
    result = aggregate(contributions, numel=NUMEL, aggregator=aggregator)
    assert torch.equal(result.tensor, x), f"seed={seed}"
    assert result.included == tuple(f"p{i}" for i in range(num)) and result.rejected == {}


@pytest.mark.parametrize("num", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("scale", [1e-8, 1.0, 1e8])
def test_close_honest_inputs(aggregator: Aggregator, num: int, scale: float) -> None:
    seed = 200 + num
    contributions, _ = _honest(num, seed=seed, scale=scale)
    result = aggregator(contributions)
    assert result.tensor.dtype == torch.float32 and result.tensor.shape == (NUMEL,)
    reference = _reference_mean(contributions)
    if aggregator.name in EXACT_ON_HONEST or num < 3:
        assert _relative_error(result.tensor, reference) < 1e-6, f"seed={seed}"
        return
    stacked = torch.stack([c.tensor for c in contributions])
    low, high = stacked.min(dim=0).values, stacked.max(dim=0).values
    assert bool(((low <= result.tensor) & (result.tensor <= high)).all()), f"seed={seed}"
    # trimming or clipping moves it off the mean, but by less than the honest spread (0.01 of |mu|)
    assert _relative_error(result.tensor, reference) < 0.01, f"seed={seed}"


def test_trimmed_mean_trims_at_least_one_from_three_on() -> None:
    trimmed = TrimmedMean()
    assert [trimmed.num_trimmed(n) for n in (1, 2, 3, 4, 5, 8, 9, 10, 20)] == [0, 0, 1, 1, 1, 2, 2, 2, 5]
    assert TrimmedMean(trim_fraction=0.45).num_trimmed(4) == 1  # at least one value is kept
    values = [
        Contribution(sender=f"p{i}", tensor=torch.tensor([float(v)]), weight=1.0) for i, v in enumerate([1, 2, 30])
    ]
    assert trimmed(values).tensor.item() == 2.0


def test_centered_clip_radius_is_scale_aware() -> None:
    contributions, _ = _honest(4, seed=3)
    tensors = [c.tensor for c in contributions]
    start = torch.stack(tensors).double().median(dim=0).values  # unused for tau given explicitly
    assert CenteredClip(tau=0.5).radius(tensors, start) == 0.5
    clip = CenteredClip()
    scaled = [t * 1000 for t in tensors]
    assert math.isclose(clip.radius(scaled, start * 1000), 1000 * clip.radius(tensors, start), rel_tol=1e-5)


@pytest.mark.parametrize(
    ("poison", "reason"),
    [
        ("nan tensor", "non-finite"),
        ("inf tensor", "non-finite"),
        ("short tensor", "shape"),
        ("2-D tensor", "shape"),
        ("float64 tensor", "dtype"),
        ("list tensor", "not a torch.Tensor"),
        ("weight nan", "not finite"),
        ("weight inf", "not finite"),
        ("weight -1", "not positive"),
        ("weight 0", "not positive"),
        ("weight 1e30", "exceeds max_weight"),
        ("weight str", "not a number"),
        ("weight bool", "not a number"),
        ("empty sender", "sender"),
    ],
)
def test_aggregate_rejects_poisoned_contributions(aggregator: Aggregator, poison: str, reason: str) -> None:
    seed = 300
    honest, _ = _honest(3, seed=seed)
    base = honest[0].tensor
    tensor, weight, sender = base.clone(), 1.0, "mallory"
    if poison.endswith("tensor"):
        tensor = {
            "nan tensor": base.clone().index_fill_(0, torch.tensor([5]), math.nan),
            "inf tensor": base.clone().index_fill_(0, torch.tensor([5]), -math.inf),
            "short tensor": base[:-1].clone(),
            "2-D tensor": base.view(2, -1).clone(),
            "float64 tensor": base.double(),
            "list tensor": base.tolist(),
        }[poison]
    elif poison.startswith("weight"):
        weight = {"nan": math.nan, "inf": math.inf, "-1": -1.0, "0": 0.0, "1e30": 1e30, "str": "5", "bool": True}[
            poison.split()[1]
        ]
    else:
        sender = ""
    bad = Contribution(sender=sender, tensor=tensor, weight=weight)  # type: ignore[arg-type]
    assert validate_contribution(bad, numel=NUMEL) is not None
    result = aggregate([*honest[:2], bad, honest[2]], numel=NUMEL, aggregator=aggregator)
    assert list(result.rejected) == [sender] and reason in result.rejected[sender], result.rejected
    assert result.included == ("honest-0", "honest-1", "honest-2")
    assert torch.equal(result.tensor, aggregator(honest).tensor), f"seed={seed}"


def test_validation_accepts_good_contributions() -> None:
    honest, _ = _honest(1, seed=4)
    assert validate_contribution(honest[0], numel=NUMEL) is None
    assert validate_contribution(Contribution(sender="a", tensor=torch.zeros(3), weight=1e6), numel=3) is None
    assert "max_weight" in validate_contribution(
        Contribution(sender="a", tensor=torch.zeros(3), weight=11), numel=3, max_weight=10
    )
    with pytest.raises(ValueError, match="max_weight"):
        validate_contribution(honest[0], numel=NUMEL, max_weight=math.nan)


def test_duplicate_sender_is_dropped_entirely(aggregator: Aggregator) -> None:
    honest, _ = _honest(3, seed=5)
    twice = Contribution(sender="honest-1", tensor=honest[0].tensor, weight=1.0)
    result = aggregate([*honest, twice], numel=NUMEL, aggregator=aggregator)
    assert result.included == ("honest-0", "honest-2") and "one per sender" in result.rejected["honest-1"]


def test_nothing_left_raises(aggregator: Aggregator) -> None:
    bad = Contribution(sender="a", tensor=torch.full((NUMEL,), math.nan), weight=1.0)
    with pytest.raises(ValueError, match="no valid contribution"):
        aggregate([bad], numel=NUMEL, aggregator=aggregator)
    with pytest.raises(ValueError, match="no contributions"):
        aggregator([])
    with pytest.raises(ValueError, match="expected"):
        aggregator(
            [
                Contribution(sender="a", tensor=torch.zeros(3), weight=1.0),
                Contribution(sender="b", tensor=torch.zeros(4), weight=1.0),
            ]
        )


def test_registry_and_settings() -> None:
    assert AGGREGATOR_NAMES == ("mean", "trimmed_mean", "centered_clip")
    assert isinstance(get_aggregator(), CenteredClip) and isinstance(get_aggregator("mean"), Mean)
    assert get_aggregator("trimmed_mean", trim_fraction=0.3) == TrimmedMean(trim_fraction=0.3)
    with pytest.raises(ValueError, match="mean, trimmed_mean, centered_clip"):
        get_aggregator("median")
    for bad in (
        {"tau": -1.0},
        {"tau": math.inf},
        {"tau_scale": 0.0},
        {"exclude_scale": 0.5},
        {"exclude_scale": math.nan},
        {"max_iterations": 0},
        {"tolerance": math.nan},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            CenteredClip(**bad)
    for trim in (0.0, 0.5, -0.1):
        with pytest.raises(ValueError, match="trim_fraction"):
            TrimmedMean(trim_fraction=trim)


# --- TESTMATRIX row 9: byzantine updates, with the plain mean as negative control -----------------

ROBUST_MAX_ERROR = 0.05  # relative to the honest mean; honest spread is 0.01 of |mu|
HURT_MIN_ERROR = 0.5  # the plain mean under attack must be at least this far off


def _attack(kind: str, honest: list[Contribution], *, seed: int) -> Contribution:
    if kind == "sign_flip_x10":
        return Contribution(sender="mallory", tensor=-10 * honest[0].tensor, weight=1.0)
    huge = 1e6 * torch.randn(honest[0].tensor.numel(), generator=_generator(seed + 1))
    return Contribution(sender="mallory", tensor=huge, weight=1.0)


@pytest.mark.parametrize("kind", ["sign_flip_x10", "huge"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_byzantine_attacker_is_contained(kind: str, seed: int) -> None:
    honest, _ = _honest(3, seed=seed, numel=10_000)
    honest = [Contribution(sender=c.sender, tensor=c.tensor, weight=1.0) for c in honest]
    reference = _reference_mean(honest)
    contributions = [honest[0], _attack(kind, honest, seed=seed), honest[1], honest[2]]
    errors = {
        name: _relative_error(aggregate(contributions, numel=10_000, aggregator=name).tensor, reference)
        for name in AGGREGATOR_NAMES
    }
    assert errors["mean"] > HURT_MIN_ERROR, f"seed={seed}: the attack did not fire: {errors}"
    for name in ROBUST:
        assert errors[name] < ROBUST_MAX_ERROR, f"seed={seed}: {name} was hurt: {errors}"


@pytest.mark.parametrize("seed", [0, 1])
def test_nan_attacker_is_rejected_and_named(seed: int) -> None:
    honest, _ = _honest(3, seed=seed)
    nan = Contribution(sender="mallory", tensor=torch.full((NUMEL,), math.nan), weight=1.0)
    for name in AGGREGATOR_NAMES:
        result = aggregate([nan, *honest], numel=NUMEL, aggregator=name)
        assert set(result.rejected) == {"mallory"} and "non-finite" in result.rejected["mallory"]
        assert "mallory" not in result.included and bool(torch.isfinite(result.tensor).all()), f"seed={seed}"


@pytest.mark.parametrize("seed", [0, 1])
def test_a_heavy_outlier_is_left_out_by_the_default_rule_and_capped_by_the_median_cap(seed: int) -> None:
    honest, _ = _honest(3, seed=seed, numel=10_000)
    honest = [Contribution(sender=c.sender, tensor=c.tensor, weight=1.0) for c in honest]
    reference = _reference_mean(honest)
    heavy = Contribution(sender="mallory", tensor=-10 * honest[0].tensor, weight=1000.0)
    contributions = [*honest, heavy]

    def error(aggregator: Aggregator | str, **cap: float) -> float:
        result = aggregate(contributions, numel=10_000, aggregator=aggregator, **cap)
        assert result.rejected == {} and "mallory" in result.included
        return _relative_error(result.tensor, reference)

    # the default CenteredClip leaves a gross outlier out whatever weight it claims
    assert error("centered_clip") < 1e-6, f"seed={seed}"
    # negative controls: 1000x weight passes validation (max_weight 1e6) and drags the mean, and
    # CenteredClip that keeps every input (by up to τ per iteration: 20 iterations reach about 0.19 here)
    keep_all = CenteredClip(exclude_scale=None)
    assert error("mean") > HURT_MIN_ERROR and error(keep_all) > 3 * ROBUST_MAX_ERROR, f"seed={seed}"
    for aggregator in (keep_all, get_aggregator("trimmed_mean")):
        assert error(aggregator, max_weight_ratio=2.0) < ROBUST_MAX_ERROR, f"seed={seed}: {aggregator.name}"
    with pytest.raises(ValueError, match="max_weight_ratio"):
        aggregate(contributions, numel=10_000, max_weight_ratio=0.5)


@pytest.mark.parametrize("seed", [0, 1])
def test_an_input_inside_the_spread_pulls_centered_clip_by_at_most_its_share_of_tau(seed: int) -> None:
    """An attacker 2 median distances out, inside the exclusion radius, against 3 honest inputs: the result moves
    by at most its weight's share of τ (one median distance) from where the honest inputs alone would put it."""
    honest, _ = _honest(3, seed=seed, numel=10_000)
    honest = [Contribution(sender=c.sender, tensor=c.tensor, weight=1.0) for c in honest]
    clip = CenteredClip()
    alone = clip(honest).tensor.double()
    start = torch.stack([c.tensor for c in honest]).double().median(dim=0).values
    spread = float(torch.stack([torch.linalg.vector_norm(c.tensor.double() - start) for c in honest]).median())
    away = torch.randn(10_000, generator=_generator(seed + 7), dtype=torch.float64)
    inside = Contribution(sender="mallory", tensor=(alone + 2 * spread * away / away.norm()).float(), weight=1.0)
    moved = float(torch.linalg.vector_norm(clip([*honest, inside]).tensor.double() - alone))
    plain = float(torch.linalg.vector_norm(_reference_mean([*honest, inside]) - _reference_mean(honest)))
    assert 0 < moved <= 1.05 * spread / 3 < plain, f"seed={seed}: moved {moved}, spread {spread}, mean moved {plain}"


# --- TESTMATRIX row 10: poisoned weights ----------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_poisoned_weights_are_rejected_and_counted(seed: int) -> None:
    honest, _ = _honest(4, seed=seed)
    claims = {"nan": math.nan, "negative": -3.0, "zero": 0.0, "1e30": 1e30}
    poisoned = [Contribution(sender=f"liar-{k}", tensor=honest[0].tensor, weight=v) for k, v in claims.items()]
    for name in AGGREGATOR_NAMES:
        result = aggregate([*poisoned, *honest], numel=NUMEL, aggregator=name)
        assert len(result.rejected) == len(claims), f"seed={seed}: {result.rejected}"
        assert set(result.rejected) == {f"liar-{k}" for k in claims}
        assert result.included == tuple(c.sender for c in honest)
        assert torch.equal(result.tensor, get_aggregator(name)(honest).tensor), f"seed={seed}"


def _centered_clip_reference(contributions: list[Contribution], *, tau_scale: float, exclude_scale: float | None):
    """The CenteredClip iteration as the paper writes it, on float64 vectors (no Gram matrix), for n >= 3."""
    xs = [c.tensor.double() for c in contributions]
    ws = [c.weight for c in contributions]
    middle = torch.stack(xs).sort(dim=0).values[(len(xs) - 1) // 2 : len(xs) // 2 + 1]
    estimate = middle.mean(0)  # the coordinate median (the mean of the two middle values for an even count)
    distances = [float(torch.linalg.vector_norm(x - estimate)) for x in xs]
    spread = (
        sorted(distances)[len(xs) // 2]
        if len(xs) % 2
        else sum(sorted(distances)[len(xs) // 2 - 1 : len(xs) // 2 + 1]) / 2
    )
    if exclude_scale is not None:
        xs, ws = zip(*[(x, w) for x, w, d in zip(xs, ws, distances) if d <= exclude_scale * spread])
    tau, total = tau_scale * spread, sum(ws)
    for _ in range(20):
        step = (
            sum(
                w * min(1.0, tau / max(float(torch.linalg.vector_norm(x - estimate)), 1e-300)) * (x - estimate)
                for x, w in zip(xs, ws)
            )
            / total
        )
        estimate = estimate + step
        if float(torch.linalg.vector_norm(step)) <= 1e-6 * tau:
            break
    return estimate


@pytest.mark.parametrize("num", [3, 4, 5, 8])
@pytest.mark.parametrize("seed", [0, 1])
def test_centered_clip_equals_the_plain_iteration(num: int, seed: int) -> None:
    """The rule iterates on coefficients over the inputs' Gram matrix; the plain iteration gives the same result,
    with and without an outlier to leave out and with the radius of the earlier default."""
    generator = _generator(300 + 10 * num + seed)
    mu = torch.randn(5000, generator=generator, dtype=torch.float64)
    tensors = [(mu + 0.7 * torch.randn(5000, generator=generator, dtype=torch.float64)).float() for _ in range(num)]
    tensors[-1] = -10 * tensors[-1] if seed else tensors[-1]
    contributions = [Contribution(sender=f"p{i}", tensor=t, weight=1.0 + i) for i, t in enumerate(tensors)]
    for tau_scale, exclude_scale in ((1.0, 2.0), (3.0, None), (1.0, None)):
        rule = CenteredClip(tau_scale=tau_scale, exclude_scale=exclude_scale)
        reference = _centered_clip_reference(contributions, tau_scale=tau_scale, exclude_scale=exclude_scale)
        assert _relative_error(rule(contributions).tensor, reference) < 1e-6, (num, seed, tau_scale, exclude_scale)


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 8, 16, 17])
def test_the_coordinate_median_equals_the_sorted_middle_exactly(count: int) -> None:
    """The min/max network (up to 16 inputs) and the sort (beyond) give the sorted middle values, ties included."""
    generator = torch.Generator().manual_seed(count)
    tensors = [torch.randn(5000, generator=generator).round(decimals=1) for _ in range(count)]  # many ties
    values = torch.stack(tensors).double().sort(dim=0).values
    middle = count // 2
    expected = values[middle] if count % 2 else (values[middle - 1] + values[middle]) / 2
    assert torch.equal(_coordinate_median(tensors), expected)
