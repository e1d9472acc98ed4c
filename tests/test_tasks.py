"""The built-in task registry and the charlm task: registry errors, sharding, determinism, learning."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bootstrap.errors import ConfigError
from swarm.tasks import PRESETS, CharLMConfig, CharLMTask, Task, UnknownTaskError, get_task, known_tasks, num_params
from swarm.tasks.charlm import corpus_text

SEED = 1234


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: the timings the suite was sized for, and no oversubscription under xdist."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tiny() -> CharLMTask:
    return get_task("charlm", preset="tiny")


def _state_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[key], sb[key]) for key in sa)


def _take(iterator, count: int) -> list:
    return [next(iterator) for _ in range(count)]


# --- registry -------------------------------------------------------------------------------------


def test_registry_lists_charlm_sorted():
    names = known_tasks()
    assert "charlm" in names
    assert names == sorted(names)


def test_unknown_task_error_lists_known_tasks():
    with pytest.raises(UnknownTaskError) as info:
        get_task("foo")
    assert isinstance(info.value, ValueError)
    assert str(info.value).startswith(f"unknown task 'foo'; known tasks: {', '.join(known_tasks())} (or ")
    assert "charlm" in str(info.value)


def test_get_task_presets_and_overrides():
    task = get_task("charlm", preset="tiny")
    assert isinstance(task, Task)
    assert task.name == "charlm"
    assert task.config == PRESETS["tiny"]
    overridden = get_task("charlm", preset="tiny", d_model=64, seed=7)
    assert overridden.config == dataclasses.replace(PRESETS["tiny"], d_model=64, seed=7)
    assert get_task("charlm", d_model=64).config == dataclasses.replace(PRESETS["default"], d_model=64)
    assert get_task("charlm").config == CharLMConfig()


def test_get_task_rejects_unknown_preset_and_field():
    with pytest.raises(ValueError, match=r"unknown charlm preset 'huge'; known presets: default, small, tiny"):
        get_task("charlm", preset="huge")
    with pytest.raises(ValueError, match=r"unknown charlm config field 'width'"):
        get_task("charlm", width=3)


def test_preset_sizes():
    sizes = {name: num_params(CharLMTask(config).build_model()) for name, config in PRESETS.items()}
    assert 200_000 <= sizes["tiny"] <= 400_000, sizes
    assert sizes["tiny"] < sizes["small"] < sizes["default"], sizes
    assert 2_000_000 <= sizes["default"] <= 6_000_000, sizes


def test_config_dict_is_json_and_rebuilds_the_task(tiny):
    description = json.loads(json.dumps(tiny.config_dict()))
    assert description["task"] == "charlm"
    assert description["corpus"]["vocab_size"] == tiny.vocab_size
    assert len(description["corpus"]["sha256"]) == 64
    rebuilt = get_task(description["task"], **description["config"])
    assert rebuilt.config == tiny.config
    assert rebuilt.config_dict() == tiny.config_dict()
    assert get_task("charlm", preset="tiny", seed=1).config_dict() != tiny.config_dict()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("d_model", 0),
        ("d_model", 2.5),
        ("num_layers", -1),
        ("num_heads", 0),
        ("seq_len", 0),
        ("batch_size", True),
        ("num_val_batches", 0),
        ("dropout", 1.0),
        ("dropout", -0.1),
        ("dropout", float("nan")),
        ("val_fraction", 0.0),
        ("val_fraction", 0.9),
        ("seed", -1),
        ("tie_weights", 1),
    ],
)
def test_bad_config_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        CharLMConfig(**{field: value})


def test_heads_must_divide_width():
    with pytest.raises(ValueError, match=r"d_model=100 must be divisible by num_heads=3"):
        CharLMConfig(d_model=100, num_heads=3)


def test_validation_split_must_hold_a_window():
    with pytest.raises(ValueError, match=r"val_fraction"):
        CharLMTask(CharLMConfig(val_fraction=1e-5))


# --- data -----------------------------------------------------------------------------------------


def test_vocabulary_is_the_sorted_corpus_characters(tiny):
    text = corpus_text()
    assert len(text) > 400_000
    assert tiny.vocab == "".join(sorted(set(text)))
    assert tiny.decode(tiny.encode(text[:500])) == text[:500]
    with pytest.raises(ValueError, match="not in the charlm vocabulary"):
        tiny.encode("\u2603")


def test_splits_partition_the_corpus(tiny):
    train_start, train_end = tiny.train_bounds()
    val_start, val_end = tiny.val_bounds()
    assert train_start == 0 and train_end == val_start and val_end == len(corpus_text())
    assert val_end - val_start == int(val_end * tiny.config.val_fraction)


@pytest.mark.parametrize("num_shards", [1, 2, 3, 7, 64])
def test_shards_are_disjoint_and_cover_the_training_split(tiny, num_shards):
    bounds = [tiny.shard_bounds(index, num_shards) for index in range(num_shards)]
    train_start, train_end = tiny.train_bounds()
    assert bounds[0][0] == train_start
    assert bounds[-1][1] == train_end
    for (_, end), (next_start, _) in itertools.pairwise(bounds):
        assert end == next_start
    assert all(start < end for start, end in bounds)


@settings(max_examples=50, deadline=None)
@given(num_shards=st.integers(min_value=1, max_value=5000), data=st.data())
def test_shard_bounds_property(tiny, num_shards, data):
    index = data.draw(st.integers(min_value=0, max_value=num_shards - 1))
    start, end = tiny.shard_bounds(index, num_shards)
    train_chars = tiny.train_bounds()[1]
    assert 0 <= start <= end <= train_chars
    # Shards differ in size by at most one character.
    assert abs((end - start) - train_chars / num_shards) < 1


@pytest.mark.parametrize(("shard_index", "num_shards"), [(0, 0), (-1, 4), (4, 4), (0, 2.0), (True, 2)])
def test_bad_shard_arguments_raise(tiny, shard_index, num_shards):
    with pytest.raises(ValueError, match=r"shard_index|num_shards"):
        tiny.train_batches(shard_index=shard_index, num_shards=num_shards)


def test_shard_too_small_for_a_window_raises_eagerly(tiny):
    num_shards = tiny.train_bounds()[1] // tiny.config.seq_len
    with pytest.raises(ValueError, match=r"fewer than seq_len \+ 1"):
        tiny.train_batches(shard_index=0, num_shards=num_shards)


@pytest.mark.parametrize(("shard_index", "num_shards"), [(0, 1), (2, 5), (39, 40)])
def test_train_batches_come_from_their_shard(tiny, shard_index, num_shards):
    text, seq_len, batch_size = corpus_text(), tiny.config.seq_len, tiny.config.batch_size
    start, end = tiny.shard_bounds(shard_index, num_shards)
    kwargs = dict(shard_index=shard_index, num_shards=num_shards, seed=SEED)
    offsets = _take(tiny.train_window_offsets(**kwargs), 20)
    batches = _take(tiny.train_batches(**kwargs), 20)
    for batch_offsets, (inputs, targets) in zip(offsets, batches, strict=True):
        assert inputs.shape == targets.shape == (batch_size, seq_len)
        assert inputs.dtype == targets.dtype == torch.long and inputs.device.type == "cpu"
        assert int(batch_offsets.min()) >= start and int(batch_offsets.max()) + seq_len + 1 <= end
        for row, offset in enumerate(batch_offsets.tolist()):
            assert tiny.decode(inputs[row]) == text[offset : offset + seq_len]
            assert tiny.decode(targets[row]) == text[offset + 1 : offset + seq_len + 1]


def test_tightest_shards_keep_every_window_inside(tiny):
    """Shards barely longer than a window: an off-by-one in the offset range would show up at once."""
    window_chars = tiny.config.seq_len + 1
    num_shards = tiny.train_bounds()[1] // (window_chars + 1)
    for shard_index in (0, num_shards // 2, num_shards - 1):
        start, end = tiny.shard_bounds(shard_index, num_shards)
        assert window_chars <= end - start <= window_chars + 2
        offsets = torch.cat(_take(tiny.train_window_offsets(shard_index=shard_index, num_shards=num_shards), 20))
        assert int(offsets.min()) == start and int(offsets.max()) == end - window_chars


def test_shards_draw_independent_offsets(tiny):
    """Equal-sized shards with the same seed must not walk through the same relative positions."""
    relative = []
    for shard_index in (0, 1):
        start, _ = tiny.shard_bounds(shard_index, 2)
        offsets = next(tiny.train_window_offsets(shard_index=shard_index, num_shards=2, seed=SEED))
        relative.append(offsets - start)
    assert not torch.equal(relative[0], relative[1])


def test_train_batches_are_deterministic_per_seed_and_shard():
    first, second = get_task("charlm", preset="tiny"), get_task("charlm", preset="tiny")

    def batches(task, **kwargs):
        return _take(task.train_batches(num_shards=4, **kwargs), 3)

    reference = batches(first, shard_index=1, seed=SEED)
    again = batches(second, shard_index=1, seed=SEED)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(reference, again, strict=True))
    for other in (batches(second, shard_index=1, seed=SEED + 1), batches(second, shard_index=2, seed=SEED)):
        assert not all(torch.equal(a[0], b[0]) for a, b in zip(reference, other, strict=True))


def test_val_batches_are_fixed_and_inside_the_val_split(tiny):
    other = get_task("charlm", preset="tiny")
    batches, other_batches = tiny.val_batches(), other.val_batches()
    assert 1 <= len(batches) <= tiny.config.num_val_batches
    assert len(batches) == len(other_batches)
    for (x, y), (ox, oy) in zip(batches, other_batches, strict=True):
        assert torch.equal(x, ox) and torch.equal(y, oy)
    val_start, val_end = tiny.val_bounds()
    offsets = tiny.val_window_offsets()
    assert int(offsets.min()) >= val_start and int(offsets.max()) + tiny.config.seq_len + 1 <= val_end
    text, seq_len = corpus_text(), tiny.config.seq_len
    inputs = torch.cat([x for x, _ in batches])
    for row, offset in enumerate(offsets.tolist()):
        assert tiny.decode(inputs[row]) == text[offset : offset + seq_len]


def test_default_val_set_uses_a_short_last_batch():
    task = get_task("charlm")
    batches = task.val_batches()
    assert sum(x.size(0) for x, _ in batches) == task.val_window_offsets().numel()
    assert all(x.shape[1] == task.config.seq_len for x, _ in batches)


# --- model ----------------------------------------------------------------------------------------


def test_same_seed_same_weights_different_seed_different(tiny):
    assert _state_equal(tiny.build_model(seed=SEED), get_task("charlm", preset="tiny").build_model(seed=SEED))
    assert not _state_equal(tiny.build_model(seed=SEED), tiny.build_model(seed=SEED + 1))
    assert _state_equal(tiny.build_model(), tiny.build_model(seed=tiny.config.seed))


def test_build_model_leaves_the_global_rng_alone(tiny):
    torch.manual_seed(SEED)
    expected = torch.rand(4)
    torch.manual_seed(SEED)
    tiny.build_model()
    assert torch.equal(torch.rand(4), expected)


def test_tied_and_untied_heads():
    tied = get_task("charlm", preset="tiny").build_model()
    untied = get_task("charlm", preset="tiny", tie_weights=False).build_model()
    assert tied.head.weight is tied.tok_emb.weight
    assert untied.head.weight is not untied.tok_emb.weight
    assert num_params(untied) - num_params(tied) == untied.head.weight.numel()


def test_model_is_causal_and_shapes_logits(tiny):
    model = tiny.build_model(seed=SEED).eval()
    inputs, _ = next(tiny.train_batches(shard_index=0, num_shards=1, seed=SEED))
    logits = model(inputs)
    assert logits.shape == (*inputs.shape, tiny.vocab_size)
    changed = inputs.clone()
    changed[:, -1] = (changed[:, -1] + 1) % tiny.vocab_size
    # Changing the last character must not change any earlier prediction.
    torch.testing.assert_close(model(changed)[:, :-1], logits[:, :-1])
    assert not torch.allclose(model(changed)[:, -1], logits[:, -1])
    with pytest.raises(ValueError, match="T <= 64"):
        model(torch.zeros(1, tiny.config.seq_len + 1, dtype=torch.long))


def test_loss_matches_cross_entropy(tiny):
    model = tiny.build_model(seed=SEED)
    inputs, targets = next(tiny.train_batches(shard_index=0, num_shards=1, seed=SEED))
    expected = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    torch.testing.assert_close(tiny.loss(model, (inputs, targets)), expected)


def test_fresh_model_loss_is_near_uniform_and_mode_is_restored(tiny):
    model = tiny.build_model(seed=SEED)
    model.train()
    loss = tiny.evaluate(model, max_batches=2)
    assert abs(loss - math.log(tiny.vocab_size)) < 0.5, (loss, math.log(tiny.vocab_size))
    assert model.training
    model.eval()
    assert tiny.evaluate(model, max_batches=2) == loss
    assert not model.training
    with pytest.raises(ValueError, match="max_batches"):
        tiny.evaluate(model, max_batches=0)


def test_short_training_run_lowers_val_loss(tiny):
    model = tiny.build_model(seed=SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    start = tiny.evaluate(model)
    batches = tiny.train_batches(shard_index=0, num_shards=2, seed=SEED)
    for _ in range(80):
        loss = tiny.loss(model, next(batches))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    end = tiny.evaluate(model)
    assert end < 0.8 * start, f"val loss {start:.3f} -> {end:.3f} after 80 steps (seed {SEED})"


def test_a_task_from_a_module_path_and_what_is_refused(monkeypatch):
    """``package.module:factory`` loads a task from this installation; a factory that makes something else, a
    module that is not there and a name of no shape say so."""
    examples = Path(__file__).resolve().parents[1] / "examples" / "swarm_mlp_task"
    monkeypatch.syspath_prepend(str(examples))
    task = get_task("swarm_mlp_task:MLPTask.from_overrides", preset="tiny")
    assert task.name == "mlp" and isinstance(task, Task) and task.config.hidden == 32
    with pytest.raises(ConfigError, match=r"made a dict, not a task: it has no name, config"):
        get_task("builtins:dict")
    with pytest.raises(UnknownTaskError, match=r"cannot be loaded from this installation: No module named"):
        get_task("no_such_package.tasks:make")
    with pytest.raises(UnknownTaskError, match=r"^unknown task 'mlp'"):  # not installed: no entry point
        get_task("mlp")
