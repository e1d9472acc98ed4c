"""The DiLoCo outer optimizer: the global copy of a model's parameters and the outer step on it.

Like torchft's ``DiLoCo`` over an injected manager, it knows nothing of the network: the trainer
asks it for the round's pseudo-gradient, hands the averaged one back to `step`, and keeps its
`state_dict` in sealed checkpoints.

    delta  = global_params - local_params                 (this peer's pseudo-gradient, flat fp32)
    global = outer_optimizer(global, grad=averaged delta) (Nesterov SGD; lr 1, momentum 0: averaging)
    local  = global                                       (copied into the model)

A model's floating-point buffers (a batch norm's running mean and variance: what ``model.state_dict()`` holds
besides the parameters) ride along after the parameters (`DiLoCo.for_model`), with lr 1 and no momentum: each
round sets them to the group's weighted mean of the members' own, as data parallelism keeps one copy of them
(DDP broadcasts rank 0's), and they are sealed, loaded and exported with the parameters (``param/NAME``).
Integer buffers (a batch norm's ``num_batches_tracked``) stay each peer's own.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from swarm.recipe import OuterSettings


def outer_update(delta: torch.Tensor, buffer: torch.Tensor | None, *, lr: float, momentum: float) -> torch.Tensor:
    """What torch's SGD (Nesterov when ``momentum`` > 0, no dampening or weight decay) subtracts from the
    parameters for the gradient ``delta``, from the momentum ``buffer`` (None: its first step)."""
    if momentum <= 0:
        return lr * delta
    velocity = delta if buffer is None else momentum * buffer + delta
    return lr * (delta + momentum * velocity)


@dataclass(frozen=True, slots=True)
class PseudoGradient:
    """One round's input: this peer's pseudo-gradient and the global state it was taken against."""

    delta: torch.Tensor
    """global - local parameters, flat fp32."""
    state: torch.Tensor
    """The global parameters then the outer momentum, flat fp32 (what members agree on)."""
    digest: str
    """A short digest of ``state``: members holding different global state see different digests."""


class DiLoCo:
    """The outer optimizer over ``params`` (a model's trainable parameters, in order, named ``names``; the last
    ``buffers`` of them the model's floating-point buffers, averaged each round: see the module docstring).

    Thread-safe: the training thread steps it while a checkpoint is sealed or loaded from another.
    """

    @classmethod
    def for_model(cls, model: torch.nn.Module, settings: OuterSettings) -> DiLoCo:
        """Over ``model``'s trainable parameters, then its floating-point buffers that its state dict holds."""
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        kept = model.state_dict(keep_vars=True)
        buffers = [(n, b) for n, b in model.named_buffers() if n in kept and b.is_floating_point()]
        names, tensors = zip(*params, *buffers)
        return cls(names, tensors, settings, buffers=len(buffers))

    def __init__(
        self, names: Sequence[str], params: Sequence[torch.Tensor], settings: OuterSettings, *, buffers: int = 0
    ) -> None:
        self.names, self.params, self.settings = tuple(names), tuple(params), settings
        self.buffers = buffers
        """How many of ``params``, at the end, are the model's buffers (lr 1, no momentum: the group's mean)."""
        self.round = 0
        """The run's round counter: rounds applied to the global state (or the sealed state's round)."""
        self.model_writes = 0
        """How many times the swarm wrote the model's parameters (a node's other ranks then copy them)."""
        self._lock = threading.Lock()
        self._global = [p.detach().to("cpu", torch.float32, copy=True) for p in self.params]
        trained = len(self._global) - buffers
        groups = [{"params": self._global[:trained]}]
        if buffers:
            groups.append({"params": self._global[trained:], "lr": 1.0, "momentum": 0.0, "nesterov": False})
        self._optimizer = torch.optim.SGD(
            groups, lr=settings.lr, momentum=settings.momentum, nesterov=settings.momentum > 0
        )
        self._trained_numel = sum(b.numel() for b in self._global[:trained])
        """Coordinates of the flat state before the buffers'."""
        self._version = 0
        """Bumped whenever the global state changes (`step`, `load_state_dict`): its digest is hashed once."""
        self._digest: tuple[int, str] = (-1, "")

    def _momentum(self, param: torch.Tensor) -> torch.Tensor:
        buf = self._optimizer.state.get(param, {}).get("momentum_buffer")
        return buf if buf is not None else torch.zeros_like(param)

    def pseudo_gradient(self, local: Sequence[torch.Tensor], delta: torch.Tensor | None = None) -> PseudoGradient:
        """This round's pseudo-gradient of ``local`` (the model's parameters now, on the CPU in fp32): global -
        local, or ``delta`` if given (an overlapped phase's progress, `swarm.overlap`), with the global state."""
        state, digest = self.state()
        if delta is None:  # base - local, tensor by tensor into one copy of the base (no flat copy of local)
            delta, start = state[: state.numel() // 2].clone(), 0
            for t in local:
                delta[start : start + t.numel()].sub_(t.reshape(-1))
                start += t.numel()
        return PseudoGradient(delta=delta, state=state, digest=digest)

    def state(self) -> tuple[torch.Tensor, str]:
        """The global parameters then the outer momentum (flat fp32, a copy), and its short digest."""
        with self._lock:  # one copy: no flat base and momentum first, no bytes of them to hash
            flat = [b.reshape(-1) for b in self._global] + [self._momentum(b).reshape(-1) for b in self._global]
            state = torch.cat(flat)
            version = self._version
        hashed_at, digest = self._digest  # an overlapped phase asks twice: at its prelaunch, at its sync point
        if hashed_at != version:
            digest = hashlib.sha256(state.numpy()).hexdigest()[:32]  # the base's bytes, then the momentum's
            self._digest = (version, digest)
        return state, digest

    def step(
        self, delta: torch.Tensor, *, next_round: int, new_state: torch.Tensor | None = None, to_model: bool = True
    ) -> None:
        """global <- outer_optimizer(global, grad=delta), then copy it into the model (unless not ``to_model``:
        an overlapped round, whose model keeps training meanwhile).

        ``new_state`` (parameters then momentum, flat; the group's averaged state) first replaces the
        global state."""
        with self._lock:
            offset, total = 0, delta.numel()
            for param in self._global:
                numel = param.numel()
                if new_state is not None:
                    param.copy_(new_state[offset : offset + numel].view_as(param))
                    if self.settings.momentum > 0:
                        momentum = new_state[total + offset : total + offset + numel]
                        self._optimizer.state[param]["momentum_buffer"] = momentum.view_as(param).clone()
                param.grad = delta[offset : offset + numel].view_as(param).clone()
                offset += numel
            self._optimizer.step()
            self._optimizer.zero_grad(set_to_none=True)
            self._version += 1
            if to_model:
                self._copy_to_model()
            self.round = next_round

    def _copy_to_model(self) -> None:
        self.model_writes += 1
        with torch.no_grad():
            for param, base in zip(self.params, self._global):
                param.copy_(base)

    def to_model(self) -> None:
        """Copy the global parameters into the model."""
        with self._lock:
            self._copy_to_model()

    def global_params(self) -> list[torch.Tensor]:
        """The global parameters (copies)."""
        with self._lock:
            return [b.clone() for b in self._global]

    def global_flat(self) -> torch.Tensor:
        """The global parameters, flat fp32 (a copy)."""
        with self._lock:
            return torch.cat([b.reshape(-1) for b in self._global])

    def rebase(self, delta: torch.Tensor, *, eager: bool = False) -> torch.Tensor:
        """model <- global - ``delta`` (flat), or with ``eager`` global - the update the outer step would make
        with ``delta`` alone for the gradient (the momentum as it is, nothing stepped; "eager updates": this
        peer's own pseudo-gradient standing in for the group's mean until the round lands); returns that flat
        start of the next overlapped phase."""
        with self._lock:
            start = torch.cat([b.reshape(-1) for b in self._global]) - (self._update(delta) if eager else delta)
            offset, self.model_writes = 0, self.model_writes + 1
            with torch.no_grad():
                for param in self.params:
                    param.copy_(start[offset : offset + param.numel()].view_as(param))
                    offset += param.numel()
        return start

    def _update(self, delta: torch.Tensor) -> torch.Tensor:
        """What `step` would subtract from the global parameters for the gradient ``delta`` (flat): torch's SGD
        with this lr and momentum (Nesterov when momentum > 0), from the current momentum buffer."""
        buffer = torch.cat([self._momentum(b).reshape(-1) for b in self._global])
        cut = self._trained_numel  # the buffers after it: lr 1, no momentum
        trained = outer_update(delta[:cut], buffer[:cut], lr=self.settings.lr, momentum=self.settings.momentum)
        return torch.cat([trained, delta[cut:]]) if self.buffers else trained

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``param/NAME`` and ``momentum/NAME`` for every parameter (copies): what a checkpoint seals."""
        with self._lock:
            state = {f"param/{name}": p.detach().clone() for name, p in zip(self.names, self._global)}
            state.update({f"momentum/{name}": self._momentum(p).clone() for name, p in zip(self.names, self._global)})
        return state

    def state_dict_problem(self, state: dict[str, torch.Tensor]) -> str | None:
        """Why ``state`` (untrusted: from a checkpoint) cannot be loaded into this optimizer, or None."""
        expected = {f"{kind}/{n}": p for n, p in zip(self.names, self._global) for kind in ("param", "momentum")}
        if set(state) != set(expected):
            return "tensor names differ from this model's"
        for name, want in expected.items():
            got = state[name]
            if got.shape != want.shape or got.dtype != want.dtype or not torch.isfinite(got).all():
                return f"{name}: shape/dtype/values do not fit"
        return None

    def load_state_dict(self, state: dict[str, torch.Tensor], *, round_: int) -> None:
        """Install a checked ``state`` (see `state_dict_problem`) as the global state at ``round_``."""
        with self._lock:
            for name, base in zip(self.names, self._global):
                base.copy_(state[f"param/{name}"])
                if self.settings.momentum > 0:
                    self._optimizer.state[base]["momentum_buffer"] = state[f"momentum/{name}"].clone()
            self._version += 1
            self._copy_to_model()
            self.round = round_
