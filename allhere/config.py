"""Configuration dataclasses of the decoder and of training.

Every dataclass validates itself on construction; a bad value raises ``ConfigError`` naming the field.
``to_dict`` / ``from_dict`` give a JSON-friendly round trip. Mechanism configs live with their mechanism
(``allhere.mechanisms``) and are looked up by their ``kind`` in ``allhere.registry``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from . import registry
from .mechanisms.full import FullConfig
from .validation import ConfigError, check, check_int, is_number


@dataclass(frozen=True)
class ModelConfig:
    """A small decoder-only LM: RMSNorm, RoPE, SwiGLU MLP, any attention mechanism."""

    vocab_size: int = 256  # number of token ids
    d_model: int = 256  # residual width d
    n_layers: int = 4  # number of transformer blocks L
    n_heads: int = 8  # query heads m
    n_kv_heads: int | None = None  # key/value heads (grouped-query attention); None = n_heads
    mlp_hidden: int | None = None  # SwiGLU hidden width; None = 8/3 d rounded up to a multiple of 64
    rope_theta: float = 10000.0  # RoPE base
    norm_eps: float = 1e-5  # RMSNorm epsilon
    tie_embeddings: bool = True  # share the input embedding and the output projection
    mechanism: Any = field(default_factory=FullConfig)  # attention for every layer...
    layer_mechanisms: tuple | None = None  # ...or one mechanism per layer (overrides ``mechanism``)

    def __post_init__(self) -> None:
        c = "ModelConfig"
        for name, minimum in (("vocab_size", 2), ("d_model", 1), ("n_layers", 1), ("n_heads", 1)):
            check_int(c, name, getattr(self, name), minimum)
        check(self.d_model % self.n_heads == 0, c, "n_heads", self.n_heads,
               f"a divisor of d_model={self.d_model}")
        if self.n_kv_heads is not None:
            check_int(c, "n_kv_heads", self.n_kv_heads, 1)
            check(self.n_heads % self.n_kv_heads == 0, c, "n_kv_heads", self.n_kv_heads,
                   f"a divisor of n_heads={self.n_heads}")
        if self.mlp_hidden is not None:
            check_int(c, "mlp_hidden", self.mlp_hidden, 1)
        check((self.d_model // self.n_heads) % 2 == 0, c, "d_model", self.d_model,
               "d_model / n_heads even (RoPE rotates pairs of channels)")
        check(is_number(self.rope_theta) and self.rope_theta > 0, c, "rope_theta", self.rope_theta,
              "a finite number > 0")
        check(is_number(self.norm_eps) and self.norm_eps > 0, c, "norm_eps", self.norm_eps, "a finite number > 0")
        if self.layer_mechanisms is not None:
            mechs = tuple(self.layer_mechanisms)
            check(len(mechs) == self.n_layers, c, "layer_mechanisms", len(mechs),
                  f"exactly n_layers={self.n_layers} entries")
            object.__setattr__(self, "layer_mechanisms", mechs)
        name = "mechanism" if self.layer_mechanisms is None else "layer_mechanisms"
        for m in self.layer_mechanisms or (self.mechanism,):
            check(registry.is_config(m), c, name, m,
                  f"a mechanism config of a registered kind ({', '.join(registry.kinds())})")
            if hasattr(m, "check_dims"):
                m.check_dims(self.d_model)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hidden(self) -> int:
        return self.mlp_hidden or 64 * -(-(8 * self.d_model // 3) // 64)

    def layer_mechanism(self, i: int):
        return self.layer_mechanisms[i] if self.layer_mechanisms is not None else self.mechanism

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["mechanism"] = registry.to_dict(self.mechanism)
        if self.layer_mechanisms is not None:
            d["layer_mechanisms"] = [registry.to_dict(m) for m in self.layer_mechanisms]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"ModelConfig must be a JSON object, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"ModelConfig has no field(s) {sorted(unknown)}")
        d = dict(d)
        if "mechanism" in d:
            d["mechanism"] = registry.from_dict(d["mechanism"])
        if d.get("layer_mechanisms") is not None:
            d["layer_mechanisms"] = tuple(registry.from_dict(m) for m in d["layer_mechanisms"])
        return cls(**d)


@dataclass(frozen=True)
class TrainConfig:
    """One training run (pretraining or fine-tuning): AdamW, linear warmup, cosine decay."""

    steps: int = 1000  # optimizer steps
    batch_size: int = 16  # sequences per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step (global batch = batch_size * grad_accum)
    lr: float = 1e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    warmup_ratio: float = 0.03  # share of steps with linear warmup from 0 (the AHA paper uses 0.03)
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.95  # AdamW beta2 (the AHA paper uses 0.95)
    weight_decay: float = 0.1  # on matrices, not on norms, embeddings or routers
    clip: float = 1.0  # gradient-norm clipping; 0 disables
    lam: float | None = None  # lambda of L_reg; None = the model's AHA config value
    # Train lambda towards this share of full attention: after every step lambda is multiplied by
    # exp(lam_rate * e), e = (mu_f - target_mu_f) / target_mu_f clipped to [-1, 1] (dual ascent on log
    # lambda), starting from the lambda above and kept within [1e-6, 10]. None: lambda stays fixed.
    target_mu_f: float | None = None
    lam_rate: float = 0.05  # step size of that update (a mu_f of twice the target raises lambda ~5% a step)
    router_lr_mult: float = 1.0  # router learning rate = lr * router_lr_mult
    eval_every: int = 0  # evaluate every this many steps (0 = only at the end)
    ckpt_every: int = 100  # checkpoint every this many steps (and always at the end)
    log_every: int = 10  # record loss/mu_f in the history every this many steps
    # seeds every batch (batch k of step s is a pure function of both); pretraining also seeds the init with it
    seed: int = 0
    device: str = "cpu"  # "cpu" or "cuda"; bf16 autocast is used on CUDA
    # torch.compile the training forward (inductor). On the CPU a step of the demo's stdlib shape takes
    # ~0.87x the eager time after 10-20 s of compilation (docs/performance.md): it pays over runs of
    # thousands of steps, not over the presets' hundreds, so it is off by default. One process only.
    compile: bool = False

    def __post_init__(self) -> None:
        c = "TrainConfig"
        check(isinstance(self.compile, bool), c, "compile", self.compile, "true or false")
        for name in ("steps", "batch_size", "grad_accum", "ckpt_every", "log_every"):
            check_int(c, name, getattr(self, name), 1)
        check_int(c, "eval_every", self.eval_every, 0)
        check_int(c, "seed", self.seed, 0)
        num = lambda name, ok, expected: check(is_number(getattr(self, name)) and ok(getattr(self, name)), c,  # noqa: E731
                                               name, getattr(self, name), expected)
        num("lr", lambda x: x > 0, "a finite number > 0")
        num("min_lr_ratio", lambda x: 0 <= x <= 1, "a number in [0, 1]")
        num("warmup_ratio", lambda x: 0 <= x < 1, "a number in [0, 1)")
        num("beta1", lambda x: 0 <= x < 1, "a number in [0, 1)")
        num("beta2", lambda x: 0 <= x < 1, "a number in [0, 1)")
        num("weight_decay", lambda x: x >= 0, "a finite number >= 0")
        num("clip", lambda x: x >= 0, "a finite number >= 0 (0 disables clipping)")
        if self.lam is not None:
            num("lam", lambda x: x >= 0, "None or a finite number >= 0")
        num("router_lr_mult", lambda x: x > 0, "a finite number > 0")
        if self.target_mu_f is not None:
            num("target_mu_f", lambda x: 0 < x < 1, "None or a number in (0, 1)")
        num("lam_rate", lambda x: x > 0, "a finite number > 0")
        check(isinstance(self.device, str), c, "device", self.device, "'cpu' or 'cuda[:N]'")
        check(self.device in ("cpu", "cuda") or self.device.startswith("cuda:"), c, "device", self.device,
               "'cpu' or 'cuda[:N]'")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
