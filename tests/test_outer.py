"""The DiLoCo outer optimizer with a model's buffers (`swarm.outer`): a batch norm's running statistics are the
group's weighted mean after each round, sealed and loaded with the parameters, and the parameters step exactly
as they do without them (a single-process reference: the same optimizer over the parameters alone)."""

from __future__ import annotations

import copy
import hashlib

import torch

from swarm.outer import DiLoCo
from swarm.recipe import OuterSettings

SETTINGS = OuterSettings(lr=0.5, momentum=0.5)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def _train(model: torch.nn.Module, seed: int, steps: int = 5) -> None:
    """A few inner steps on this peer's own data (its batch norm's statistics move with it)."""
    data = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(steps):
        x = torch.randn(16, 4, generator=data) * (1 + seed)
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _local(outer: DiLoCo) -> list[torch.Tensor]:
    return [t.detach().to("cpu", torch.float32, copy=True) for t in outer.params]


def test_buffers_are_the_groups_weighted_mean_and_the_parameters_step_as_without_them() -> None:
    models = [_model(), _model()]
    outers = [DiLoCo.for_model(m, SETTINGS) for m in models]
    named = [[(n, p) for n, p in m.named_parameters()] for m in models]
    # the reference: the same optimizer over the parameters alone, on copies of the same models
    ref_models = [copy.deepcopy(m) for m in models]
    refs = [DiLoCo(*zip(*m.named_parameters()), SETTINGS) for m in ref_models]
    assert outers[0].buffers == 2 and outers[0].names[-2:] == ("1.running_mean", "1.running_var")
    assert refs[0].buffers == 0 and len(outers[0].params) == len(named[0]) + 2
    weights = [1.0, 3.0]
    for round_ in (1, 2):  # two rounds, so that the outer momentum takes part
        for i, (m, r) in enumerate(zip(models, ref_models)):
            _train(m, seed=10 * round_ + i)
            r.load_state_dict(m.state_dict())
        pseudo = [o.pseudo_gradient(_local(o)) for o in outers]
        averaged = sum(w * p.delta for w, p in zip(weights, pseudo)) / sum(weights)
        stats = {
            name: sum(w * m.get_buffer(name) for w, m in zip(weights, models)) / sum(weights)
            for name in ("1.running_mean", "1.running_var")
        }
        own_counts = [int(m.get_buffer("1.num_batches_tracked")) for m in models]
        cut = sum(p.numel() for _, p in named[0])
        ref_pseudo = [r.pseudo_gradient(_local(r)) for r in refs]
        ref_averaged = sum(w * p.delta for w, p in zip(weights, ref_pseudo)) / sum(weights)
        assert torch.equal(averaged[:cut], ref_averaged)
        for outer, ref in zip(outers, refs):
            outer.step(averaged, next_round=round_)
            ref.step(ref_averaged, next_round=round_)
        for m, r, count in zip(models, ref_models, own_counts):
            for (name, p), (_, q) in zip(m.named_parameters(), r.named_parameters()):
                assert torch.equal(p, q), (round_, name)  # the parameters: exactly as without the buffers
            for name, want in stats.items():  # the buffers: the group's weighted mean
                torch.testing.assert_close(m.get_buffer(name), want, rtol=1e-6, atol=1e-6)
            assert int(m.get_buffer("1.num_batches_tracked")) == count  # an integer buffer stays its own
        assert torch.equal(models[0].get_buffer("1.running_var"), models[1].get_buffer("1.running_var"))


def test_an_eager_start_keeps_the_buffers_own_progress_and_steps_the_parameters_as_without_them() -> None:
    model = _model()
    outer = DiLoCo.for_model(model, SETTINGS)
    ref_model = copy.deepcopy(model)
    ref = DiLoCo(*zip(*ref_model.named_parameters()), SETTINGS)
    for round_ in (1, 2):
        _train(model, seed=round_)
        ref_model.load_state_dict(model.state_dict())
        local_stats = model.get_buffer("1.running_mean").clone()
        pseudo, ref_pseudo = outer.pseudo_gradient(_local(outer)), ref.pseudo_gradient(_local(ref))
        cut = ref_pseudo.delta.numel()
        start = outer.rebase(pseudo.delta, eager=True)
        assert torch.equal(start[:cut], ref.rebase(ref_pseudo.delta, eager=True))
        # lr 1 and no momentum for the buffers: the eager start is the peer's own statistics (up to rounding)
        torch.testing.assert_close(model.get_buffer("1.running_mean"), local_stats, rtol=1e-6, atol=1e-6)
        outer.step(pseudo.delta, next_round=round_)
        ref.step(ref_pseudo.delta, next_round=round_)


def test_buffers_are_sealed_loaded_and_exported_with_the_parameters() -> None:
    donor = _model()
    outer = DiLoCo.for_model(donor, SETTINGS)
    _train(donor, seed=1)
    outer.step(outer.pseudo_gradient(_local(outer)).delta, next_round=7)
    state = outer.state_dict()
    assert {"param/1.running_mean", "param/1.running_var"} <= set(state)
    joiner = _model()  # a fresh model: its statistics at their initial values (0 and 1)
    assert not joiner.get_buffer("1.running_mean").any()
    loaded = DiLoCo.for_model(joiner, SETTINGS)
    assert loaded.state_dict_problem(state) is None
    loaded.load_state_dict(state, round_=7)
    for name in ("1.running_mean", "1.running_var", "0.weight"):
        assert torch.equal(joiner.get_buffer(name) if "running" in name else joiner.get_parameter(name),
                           donor.get_buffer(name) if "running" in name else donor.get_parameter(name)), name  # fmt: skip
    # what `python -m swarm.checkpoint export` writes: every ``param/`` entry under its model name
    exported = {k.split("/", 1)[1]: v for k, v in state.items() if k.startswith("param/")}
    _model().load_state_dict(exported)  # strict (a batch norm fills in a missing num_batches_tracked itself)
    without = {k: v for k, v in state.items() if "running" not in k}  # a model without the buffers: refused
    assert loaded.state_dict_problem(without) == "tensor names differ from this model's"


def test_verified_work_is_off_with_a_warning_for_a_model_with_buffers(caplog) -> None:
    """A replay restores the parameters and the inner optimizer's state, not the buffers: such a model's phases
    would not replay bit for bit, so its peer commits nothing (unverified) instead of being accused."""
    from types import SimpleNamespace

    from swarm.work import WorkChecks

    config = SimpleNamespace(work=SimpleNamespace(verify_work=True), overlap=False)
    trainer = SimpleNamespace(
        config=config, identity=SimpleNamespace(peer_id="me"), peer_id="me", outer=DiLoCo.for_model(_model(), SETTINGS)
    )
    with caplog.at_level("WARNING", logger="swarm.work"):
        assert WorkChecks.for_trainer(trainer, spec=object()) is None
    assert "the model has buffers" in caplog.text


def test_the_round_state_digest_and_pseudo_gradient_are_those_of_the_flat_copies() -> None:
    """`DiLoCo.state` makes one copy of the global state and hashes it in place, and `pseudo_gradient` subtracts
    the local parameters tensor by tensor (a 100M-parameter state: 2.6 -> 1.1 s a round, peak 4 -> 3 copies of
    the parameters): the digest (what members compare in the base agreement, across versions) must stay the
    sha256 of the base's bytes then the momentum's, and the pseudo-gradient ``base - local`` bit for bit."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in ((3, 4), (5,), (2, 2, 2))]
    outer = DiLoCo(["a", "b", "c"], params, OuterSettings(lr=0.5, momentum=0.5))
    local = [p.detach() + 0.1 * torch.randn(p.shape, generator=generator) for p in params]
    outer.step(outer.pseudo_gradient(local).delta, next_round=1)  # momentum buffers are not zero now
    local = [p.detach() + 0.1 * torch.randn(p.shape, generator=generator) for p in params]
    base = torch.cat([g.reshape(-1) for g in outer.global_params()])
    momentum = torch.cat([outer._momentum(g).reshape(-1) for g in outer._global])
    assert momentum.abs().sum() > 0
    pseudo = outer.pseudo_gradient(local)
    expected = hashlib.sha256(base.numpy().tobytes() + momentum.numpy().tobytes()).hexdigest()[:32]
    assert pseudo.digest == expected and torch.equal(pseudo.state, torch.cat([base, momentum]))
    assert torch.equal(pseudo.delta, base - torch.cat([t.reshape(-1) for t in local]))
    assert pseudo.delta.data_ptr() != pseudo.state.data_ptr()  # its own tensor: the state is not changed under it
