"""`charlm`: a small GPT-style character-level language model over text that ships with CPython.

The corpus is `pydoc_data.topics.topics` (the English help text behind `help('topic')`), joined in
sorted-key order: about 465k characters and about a hundred distinct ones, so nothing is ever
downloaded. The corpus differs between CPython versions; `config_dict()` carries its SHA-256 so
peers on different interpreters end up with different config digests instead of silently
training different models.

Layout of the corpus: `[0, val_start)` is the training split, cut into contiguous, disjoint shards
(one per peer); `[val_start, len)` is the last `val_fraction` of the corpus, a fixed validation
split that no shard ever reads.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Batch = tuple[Tensor, Tensor]
"""An `(inputs, targets)` pair of LongTensors of shape `[batch_size, seq_len]`; targets are inputs shifted by one."""

_MAX_SEED = 2**63 - 1


def _require_int(name: str, value: Any, *, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        upper = "" if maximum is None else f" and <= {maximum}"
        raise ValueError(f"{name} must be >= {minimum}{upper}, got {value!r}")


def _require_fraction(name: str, value: Any, *, low: float, high: float, high_inclusive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a float, got {value!r}")
    below_high = value <= high if high_inclusive else value < high
    if not (low <= value and below_high):  # also rejects NaN
        bracket = "]" if high_inclusive else ")"
        raise ValueError(f"{name} must be in [{low}, {high}{bracket}, got {value!r}")


def config_from_preset(presets: dict[str, Any], *, task: str, name: str, overrides: dict[str, Any]) -> Any:
    """``presets[name]`` with ``overrides`` applied; an unknown preset or field raises ValueError naming it."""
    if name not in presets:
        raise ValueError(f"unknown {task} preset {name!r}; known presets: {', '.join(sorted(presets))}")
    fields = [field.name for field in dataclasses.fields(presets[name])]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ValueError(f"unknown {task} config field {unknown[0]!r}; known fields: {', '.join(fields)}")
    return dataclasses.replace(presets[name], **overrides)


@dataclass(frozen=True, kw_only=True, slots=True)
class CharLMConfig:
    """Shape of the charlm model and of its data pipeline; every peer of a run must use the same one."""

    d_model: int = 256
    """Width of the residual stream (the embedding size)."""
    num_layers: int = 4
    """Number of transformer blocks."""
    num_heads: int = 4
    """Attention heads per block; must divide d_model."""
    seq_len: int = 128
    """Context length in characters: the length of every training and validation window."""
    batch_size: int = 32
    """Windows per batch, for training and validation alike."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention weights and residual branches while training."""
    val_fraction: float = 0.05
    """Fraction of the corpus, taken from its end, held out as the validation split."""
    num_val_batches: int = 8
    """Most batches in the fixed validation set (fewer if the validation split is short)."""
    tie_weights: bool = True
    """Share the output head's weight with the token embedding."""
    seed: int = 0
    """Seed of the initial weights, used by build_model when it is given no seed."""

    def __post_init__(self) -> None:
        for name in ("d_model", "num_layers", "num_heads", "seq_len", "batch_size", "num_val_batches"):
            _require_int(name, getattr(self, name), minimum=1)
        _require_int("seed", self.seed, minimum=0, maximum=_MAX_SEED)
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by num_heads={self.num_heads}")
        _require_fraction("dropout", self.dropout, low=0.0, high=1.0, high_inclusive=False)
        _require_fraction("val_fraction", self.val_fraction, low=0.0, high=0.5, high_inclusive=True)
        if self.val_fraction == 0:
            raise ValueError("val_fraction must be > 0 (the validation split cannot be empty), got 0")
        if not isinstance(self.tie_weights, bool):
            raise ValueError(f"tie_weights must be a bool, got {self.tie_weights!r}")

    @classmethod
    def preset(cls, name: str = "default", **overrides: Any) -> CharLMConfig:
        """The named preset (see PRESETS) with `overrides` applied; bad names or values raise ValueError."""
        return config_from_preset(PRESETS, task="charlm", name=name, overrides=overrides)


PRESETS: dict[str, CharLMConfig] = {
    # ~0.24M parameters: tens of steps per second on one CPU thread; tests and the CPU demo.
    "tiny": CharLMConfig(d_model=96, num_layers=2, num_heads=4, seq_len=64, batch_size=16),
    # ~0.8M parameters.
    "small": CharLMConfig(d_model=128, num_layers=4, num_heads=4, seq_len=128, batch_size=16),
    # ~3.2M parameters.
    "default": CharLMConfig(),
}
"""Named configurations; `CharLMConfig.preset(name)` returns one."""


# --- corpus ---------------------------------------------------------------------------------------


@functools.cache
def corpus_text() -> str:
    """The whole corpus: pydoc_data's topic texts joined in sorted-key order (deterministic per CPython)."""
    from pydoc_data.topics import topics

    return "".join(topics[key] for key in sorted(topics))


@functools.cache
def _vocabulary() -> str:
    return "".join(sorted(set(corpus_text())))


@functools.cache
def _corpus_sha256() -> str:
    return hashlib.sha256(corpus_text().encode("utf-8")).hexdigest()


@functools.cache
def _corpus_tokens() -> Tensor:
    # Shared by every task instance; only ever read (indexing below copies).
    index_of = {char: index for index, char in enumerate(_vocabulary())}
    return torch.tensor([index_of[char] for char in corpus_text()], dtype=torch.long)


def _stream_seed(seed: int, shard_index: int) -> int:
    """A 63-bit seed for shard `shard_index`'s window stream, stable across processes and platforms."""
    digest = hashlib.blake2b(f"charlm:{seed}:{shard_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MAX_SEED


# --- model ----------------------------------------------------------------------------------------


class _CausalSelfAttention(nn.Module):
    def __init__(self, config: CharLMConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        batch, time, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, time, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(batch, time, width)))


class _MLP(nn.Module):
    def __init__(self, config: CharLMConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, 4 * config.d_model)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * config.d_model, config.d_model)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.proj(self.act(self.fc(x))))


class _Block(nn.Module):
    def __init__(self, config: CharLMConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = _CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = _MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class CharTransformer(nn.Module):
    """Decoder-only transformer: token + learned position embedding, pre-LN blocks, final LN, linear head."""

    def __init__(self, config: CharLMConfig, *, vocab_size: int) -> None:
        super().__init__()
        self.seq_len = config.seq_len
        self.tok_emb = nn.Embedding(vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.emb_dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, vocab_size, bias=False)
        if config.tie_weights:
            self.head.weight = self.tok_emb.weight

    def forward(self, idx: Tensor) -> Tensor:
        """Logits `[B, T, vocab]` for token ids `[B, T]`, T <= seq_len; position t sees ids 0..t only."""
        if idx.dim() != 2 or idx.size(1) > self.seq_len:
            raise ValueError(f"expected token ids of shape [B, T] with T <= {self.seq_len}, got {tuple(idx.shape)}")
        positions = torch.arange(idx.size(1), device=idx.device)
        x = self.emb_dropout(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@torch.no_grad()
def _init_weights(model: CharTransformer, *, num_layers: int, generator: torch.Generator) -> None:
    """GPT-2 initialisation drawn from `generator` alone, in module order, so it is reproducible."""
    residual_std = 0.02 / math.sqrt(2 * num_layers)  # keeps the residual stream's variance flat with depth
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            std = residual_std if name.endswith(".proj") else 0.02
            module.weight.normal_(0.0, std, generator=generator)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, 0.02, generator=generator)
        elif isinstance(module, nn.LayerNorm):
            module.weight.fill_(1.0)
            module.bias.zero_()


def _model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


# --- task -----------------------------------------------------------------------------------------


def evaluate_batches(
    model: nn.Module, batches: list[Any], max_batches: int | None, mean_loss: Callable[[nn.Module, list[Any]], float]
) -> float:
    """``mean_loss(model, batches[:max_batches])`` (all batches by default) in eval mode without gradients; the
    model's train/eval mode is restored. Every built-in task's ``evaluate``."""
    if max_batches is not None:
        _require_int("max_batches", max_batches, minimum=1)
        batches = batches[:max_batches]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return mean_loss(model, batches)
    finally:
        model.train(was_training)


class CharLMTask:
    """The `charlm` task: model factory, sharded training stream and fixed validation set for one config."""

    name = "charlm"

    def __init__(self, config: CharLMConfig | None = None) -> None:
        self.config = PRESETS["default"] if config is None else config
        if not isinstance(self.config, CharLMConfig):
            raise TypeError(f"config must be a CharLMConfig, got {type(self.config).__name__}")
        self._tokens = _corpus_tokens()
        num_chars = self._tokens.numel()
        self._val_start = num_chars - int(num_chars * self.config.val_fraction)
        self._check_split_sizes()
        self._val_batches: list[Batch] | None = None

    @property
    def random_in_training(self) -> bool:
        """Whether a training step draws random numbers (dropout): its verified work replays in a process of
        its own (`swarm.replayer`)."""
        return self.config.dropout > 0

    @classmethod
    def from_overrides(cls, preset: str = "default", **overrides: Any) -> CharLMTask:
        """The task for `CharLMConfig.preset(preset, **overrides)`."""
        return cls(CharLMConfig.preset(preset, **overrides))

    def _check_split_sizes(self) -> None:
        window_chars = self.config.seq_len + 1
        val_chars = self._tokens.numel() - self._val_start
        if val_chars < window_chars:
            raise ValueError(
                f"val_fraction={self.config.val_fraction} leaves {val_chars} validation characters, "
                f"fewer than seq_len + 1 = {window_chars}; raise val_fraction or lower seq_len"
            )
        if self._val_start < window_chars:
            raise ValueError(
                f"the training split holds {self._val_start} characters, fewer than seq_len + 1 = "
                f"{window_chars}; lower val_fraction or seq_len"
            )

    # --- vocabulary

    @property
    def vocab(self) -> str:
        """The characters of the vocabulary; token id i is `vocab[i]`."""
        return _vocabulary()

    @property
    def vocab_size(self) -> int:
        return len(_vocabulary())

    def encode(self, text: str) -> Tensor:
        """Token ids of `text`; raises ValueError on a character outside the vocabulary."""
        index_of = {char: index for index, char in enumerate(self.vocab)}
        missing = sorted(set(text) - set(index_of))
        if missing:
            raise ValueError(f"characters not in the charlm vocabulary: {''.join(missing)!r}")
        return torch.tensor([index_of[char] for char in text], dtype=torch.long)

    def decode(self, ids: Tensor) -> str:
        """The text of a 1-D tensor of token ids."""
        return "".join(self.vocab[index] for index in ids.tolist())

    # --- identity

    def config_dict(self) -> dict[str, Any]:
        """JSON-able description of everything that shapes the model and data: task, config and corpus."""
        return {
            "task": self.name,
            "config": dataclasses.asdict(self.config),
            "corpus": {
                "source": "pydoc_data.topics",
                "num_chars": self._tokens.numel(),
                "vocab_size": self.vocab_size,
                "sha256": _corpus_sha256(),
            },
        }

    # --- model

    def build_model(self, *, seed: int | None = None) -> CharTransformer:
        """A fresh model on the CPU whose weights depend only on the config and `seed` (default config.seed).

        The global RNG is left as it was, so building a model never perturbs the caller's randomness.
        """
        seed = self.config.seed if seed is None else seed
        _require_int("seed", seed, minimum=0, maximum=_MAX_SEED)
        with torch.random.fork_rng(devices=[]):
            model = CharTransformer(self.config, vocab_size=self.vocab_size)
        generator = torch.Generator().manual_seed(seed)
        _init_weights(model, num_layers=self.config.num_layers, generator=generator)
        return model

    def loss(self, model: nn.Module, batch: Batch) -> Tensor:
        """Mean next-character cross-entropy of `model` on `batch`, computed on the model's device."""
        inputs, targets = (t.to(_model_device(model)) for t in batch)
        logits = model(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    # --- training data

    def train_bounds(self) -> tuple[int, int]:
        """Character offsets `[start, end)` of the training split."""
        return 0, self._val_start

    def val_bounds(self) -> tuple[int, int]:
        """Character offsets `[start, end)` of the validation split; disjoint from the training split."""
        return self._val_start, self._tokens.numel()

    def shard_bounds(self, shard_index: int, num_shards: int) -> tuple[int, int]:
        """Character offsets `[start, end)` of one of `num_shards` contiguous, disjoint training shards."""
        _require_int("num_shards", num_shards, minimum=1)
        _require_int("shard_index", shard_index, minimum=0, maximum=num_shards - 1)
        train_chars = self._val_start
        return train_chars * shard_index // num_shards, train_chars * (shard_index + 1) // num_shards

    def train_window_offsets(self, *, shard_index: int, num_shards: int, seed: int = 0) -> Iterator[Tensor]:
        """Endless stream of `[batch_size]` window start offsets inside the shard, seeded by (seed, shard_index).

        Window `o` covers characters `o .. o + seq_len` (inclusive), all inside the shard.
        Arguments are checked now, not on the first `next()`.
        """
        start, end = self.shard_bounds(shard_index, num_shards)
        _require_int("seed", seed, minimum=0, maximum=_MAX_SEED)
        window_chars = self.config.seq_len + 1
        if end - start < window_chars:
            raise ValueError(
                f"shard {shard_index} of {num_shards} holds {end - start} characters, fewer than "
                f"seq_len + 1 = {window_chars}; use fewer shards or a shorter seq_len"
            )
        generator = torch.Generator().manual_seed(_stream_seed(seed, shard_index))
        return self._offset_stream(start, end - self.config.seq_len, generator)

    def _offset_stream(self, low: int, high: int, generator: torch.Generator) -> Iterator[Tensor]:
        while True:
            yield torch.randint(low, high, (self.config.batch_size,), generator=generator)

    def train_batches(self, *, shard_index: int, num_shards: int, seed: int = 0) -> Iterator[Batch]:
        """Endless stream of CPU batches drawn only from shard `shard_index` of `num_shards`.

        The same (config, shard_index, num_shards, seed) always yields the same batches.
        """
        offsets = self.train_window_offsets(shard_index=shard_index, num_shards=num_shards, seed=seed)
        return (self._windows(batch_offsets) for batch_offsets in offsets)

    def _windows(self, offsets: Tensor) -> Batch:
        index = offsets.unsqueeze(1) + torch.arange(self.config.seq_len + 1)
        windows = self._tokens[index]
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    # --- validation

    def val_window_offsets(self) -> Tensor:
        """Start offsets of the fixed validation windows: evenly spread over the validation split."""
        val_start, val_end = self.val_bounds()
        seq_len = self.config.seq_len
        last_offset = val_end - seq_len - 1
        max_windows = self.config.num_val_batches * self.config.batch_size
        num_windows = max(1, min(max_windows, (val_end - val_start) // seq_len))
        step_numerators = torch.arange(num_windows) * (last_offset - val_start)
        return val_start + step_numerators // max(num_windows - 1, 1)

    def val_batches(self) -> list[Batch]:
        """The fixed validation set as CPU batches (the last may be short); identical in every process."""
        if self._val_batches is None:
            offsets = self.val_window_offsets().split(self.config.batch_size)
            self._val_batches = [self._windows(batch_offsets) for batch_offsets in offsets]
        return list(self._val_batches)

    def evaluate(self, model: nn.Module, *, max_batches: int | None = None) -> float:
        """Mean per-character validation loss over the first `max_batches` batches (all by default).

        Runs in eval mode without gradients on the model's device; the model's mode is restored.
        """
        return evaluate_batches(model, self.val_batches(), max_batches, self._mean_loss)

    @staticmethod
    def _mean_loss(model: nn.Module, batches: list[Batch]) -> float:
        device = _model_device(model)
        total_loss, total_chars = 0.0, 0
        for inputs, targets in batches:
            logits = model(inputs.to(device))
            flat_logits = logits.reshape(-1, logits.size(-1))
            total_loss += F.cross_entropy(flat_logits, targets.to(device).reshape(-1), reduction="sum").item()
            total_chars += targets.numel()
        return total_loss / total_chars
