"""Configuration dataclasses: one per attention mechanism, one for the decoder.

Every dataclass validates itself on construction; a bad value raises ``ConfigError`` naming the field.
``to_dict`` / ``from_dict`` give a JSON-friendly round trip (the ``kind`` key picks the mechanism).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Union


class ConfigError(ValueError):
    """A configuration field holds an invalid value. The message names the field."""


def _check(ok: bool, cls: str, name: str, value: Any, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{cls}.{name} = {value!r} is invalid: expected {expected}")


def _int(cls: str, name: str, value: Any, minimum: int) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
    _check(ok, cls, name, value, f"an integer >= {minimum}")


@dataclass(frozen=True)
class FullConfig:
    """Ordinary causal attention over the whole prefix."""

    kind: str = field(default="full", init=False)


@dataclass(frozen=True)
class SlidingConfig:
    """Sliding-window attention: query i sees keys j with 0 <= i - j < window (itself included)."""

    window: int = 256  # number of most recent keys each query sees, the current token included

    kind: str = field(default="sliding", init=False)

    def __post_init__(self) -> None:
        _int("SlidingConfig", "window", self.window, 1)


ROUTER_KINDS = ("linear", "qproj")
ROUTER_INITS = ("global", "neutral", "local")


@dataclass(frozen=True)
class AHAConfig:
    """All-or-Here attention (seeds/003): per (token, head) a hard gate picks full or windowed attention.

    Router initialisation (``router_init``):
      - ``"global"``: W_router = 0 and bias = +``router_init_bias`` (default 3, score ~0.95 > tau), so every
        gate starts open and a converted model computes exactly what the pretrained full-attention model
        computed; the L1 penalty then closes the gates that the language-model loss does not defend. This
        is the default because fine-tuning starts from the pretrained model's quality.
      - ``"neutral"``: W_router ~ N(0, 0.02), bias 0: scores near 0.5, about half the gates open at random.
      - ``"local"``: W_router = 0 and bias = -``router_init_bias``: starts as a sliding-window model and
        opens gates only where the loss asks for it.
    The paper's router has no bias (S = sigmoid(X W)); ``router_bias=False`` gives exactly that, and then
    "global"/"local" initialise with W = 0 (scores 0.5, every gate closed since the gate is s > tau).
    """

    window: int = 256  # w: a local (token, head) sees its w most recent keys, itself included
    tau: float = 0.5  # threshold of the hard gate g = 1[s > tau] (Eq. 2)
    lam: float = 3e-4  # lambda, weight of L_reg = mean router score (Eqs. 6-7)
    router: str = "linear"  # "linear": separate W_router (d x m); "qproj": m extra q_proj output channels
    router_bias: bool = True  # add a learned bias to the router logits (not in the paper's Eq. 1)
    router_init: str = "global"  # "global" | "neutral" | "local", see the class docstring
    router_init_bias: float = 3.0  # magnitude of the initial bias for "global"/"local"

    kind: str = field(default="aha", init=False)

    def __post_init__(self) -> None:
        c = "AHAConfig"
        _int(c, "window", self.window, 1)
        _check(isinstance(self.tau, (int, float)) and 0.0 < self.tau < 1.0, c, "tau", self.tau,
               "a number strictly between 0 and 1")
        _check(isinstance(self.lam, (int, float)) and self.lam >= 0.0, c, "lam", self.lam, "a number >= 0")
        _check(self.router in ROUTER_KINDS, c, "router", self.router, f"one of {ROUTER_KINDS}")
        _check(isinstance(self.router_bias, bool), c, "router_bias", self.router_bias, "True or False")
        _check(self.router_init in ROUTER_INITS, c, "router_init", self.router_init, f"one of {ROUTER_INITS}")
        _check(isinstance(self.router_init_bias, (int, float)) and self.router_init_bias >= 0.0, c,
               "router_init_bias", self.router_init_bias, "a number >= 0")


@dataclass(frozen=True)
class DARConfig:
    """Distance-adaptive representation (seeds/001): keys/values of the ``window`` most recent tokens come
    from the full hidden state h, those of older tokens from h' = (h W_down) W_up, one softmax over all.

    window = 0 sends every token through the bottleneck (the "uniform reduction" baseline); d_down = d
    keeps the modules but no bottleneck.
    """

    window: int = 128  # w: tokens j with i - j < w use full-dimensional K/V (the current token included)
    d_down: int = 64  # bottleneck width of W_down (d x d_down) and W_up (d_down x d)

    kind: str = field(default="dar", init=False)

    def __post_init__(self) -> None:
        _int("DARConfig", "window", self.window, 0)
        _int("DARConfig", "d_down", self.d_down, 1)


MechanismConfig = Union[FullConfig, SlidingConfig, AHAConfig, DARConfig]
MECHANISMS: dict[str, type] = {"full": FullConfig, "sliding": SlidingConfig, "aha": AHAConfig, "dar": DARConfig}


def mechanism_to_dict(cfg: MechanismConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def mechanism_from_dict(d: dict[str, Any]) -> MechanismConfig:
    if not isinstance(d, dict) or d.get("kind") not in MECHANISMS:
        raise ConfigError(f"mechanism.kind must be one of {sorted(MECHANISMS)}, got {d!r}")
    cls = MECHANISMS[d["kind"]]
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = set(d) - known - {"kind"}
    if unknown:
        raise ConfigError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    return cls(**{k: v for k, v in d.items() if k in known})


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
    mechanism: MechanismConfig = field(default_factory=FullConfig)  # attention for every layer...
    layer_mechanisms: tuple | None = None  # ...or one mechanism per layer (overrides ``mechanism``)

    def __post_init__(self) -> None:
        c = "ModelConfig"
        for name, minimum in (("vocab_size", 2), ("d_model", 1), ("n_layers", 1), ("n_heads", 1)):
            _int(c, name, getattr(self, name), minimum)
        _check(self.d_model % self.n_heads == 0, c, "n_heads", self.n_heads,
               f"a divisor of d_model={self.d_model}")
        if self.n_kv_heads is not None:
            _int(c, "n_kv_heads", self.n_kv_heads, 1)
            _check(self.n_heads % self.n_kv_heads == 0, c, "n_kv_heads", self.n_kv_heads,
                   f"a divisor of n_heads={self.n_heads}")
        if self.mlp_hidden is not None:
            _int(c, "mlp_hidden", self.mlp_hidden, 1)
        _check((self.d_model // self.n_heads) % 2 == 0, c, "d_model", self.d_model,
               "d_model / n_heads even (RoPE rotates pairs of channels)")
        _check(self.rope_theta > 0, c, "rope_theta", self.rope_theta, "a number > 0")
        _check(self.norm_eps > 0, c, "norm_eps", self.norm_eps, "a number > 0")
        _check(isinstance(self.mechanism, tuple(MECHANISMS.values())), c, "mechanism", self.mechanism,
               "a FullConfig, SlidingConfig, AHAConfig or DARConfig")
        if self.layer_mechanisms is not None:
            mechs = tuple(self.layer_mechanisms)
            _check(len(mechs) == self.n_layers, c, "layer_mechanisms", len(mechs),
                   f"exactly n_layers={self.n_layers} entries")
            for m in mechs:
                _check(isinstance(m, tuple(MECHANISMS.values())), c, "layer_mechanisms", m,
                       "FullConfig, SlidingConfig, AHAConfig or DARConfig entries")
            object.__setattr__(self, "layer_mechanisms", mechs)
        for m in self.layer_mechanisms or (self.mechanism,):
            if isinstance(m, DARConfig):
                _check(m.d_down <= self.d_model, "DARConfig", "d_down", m.d_down, f"<= d_model={self.d_model}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hidden(self) -> int:
        return self.mlp_hidden or 64 * -(-(8 * self.d_model // 3) // 64)

    def layer_mechanism(self, i: int) -> MechanismConfig:
        return self.layer_mechanisms[i] if self.layer_mechanisms is not None else self.mechanism

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["mechanism"] = mechanism_to_dict(self.mechanism)
        if self.layer_mechanisms is not None:
            d["layer_mechanisms"] = [mechanism_to_dict(m) for m in self.layer_mechanisms]
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
            d["mechanism"] = mechanism_from_dict(d["mechanism"])
        if d.get("layer_mechanisms") is not None:
            d["layer_mechanisms"] = tuple(mechanism_from_dict(m) for m in d["layer_mechanisms"])
        return cls(**d)


@dataclass(frozen=True)
class TrainConfig:
    """One training run (pretraining or fine-tuning): AdamW, linear warmup, cosine decay."""

    steps: int = 1000  # optimizer steps
    batch_size: int = 16  # sequences per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step (global batch = batch_size * grad_accum)
    lr: float = 1e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    warmup_ratio: float = 0.03  # share of steps with linear warmup from 0 (seeds/003 uses 0.03)
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.95  # AdamW beta2 (seeds/003 uses 0.95)
    weight_decay: float = 0.1  # on matrices, not on norms, embeddings or routers
    clip: float = 1.0  # gradient-norm clipping; 0 disables
    lam: float | None = None  # lambda of L_reg; None = the model's AHA config value
    router_lr_mult: float = 1.0  # router learning rate = lr * router_lr_mult
    eval_every: int = 0  # evaluate every this many steps (0 = only at the end)
    ckpt_every: int = 100  # checkpoint every this many steps (and always at the end)
    log_every: int = 10  # record loss/mu_f in the history every this many steps
    seed: int = 0  # seeds the model init and every batch (batch k of step s is a pure function of both)
    device: str = "cpu"  # "cpu" or "cuda"; bf16 autocast is used on CUDA

    def __post_init__(self) -> None:
        c = "TrainConfig"
        for name in ("steps", "batch_size", "grad_accum", "ckpt_every", "log_every"):
            _int(c, name, getattr(self, name), 1)
        _int(c, "eval_every", self.eval_every, 0)
        _int(c, "seed", self.seed, 0)
        _check(self.lr > 0, c, "lr", self.lr, "a number > 0")
        _check(0 <= self.min_lr_ratio <= 1, c, "min_lr_ratio", self.min_lr_ratio, "a number in [0, 1]")
        _check(0 <= self.warmup_ratio < 1, c, "warmup_ratio", self.warmup_ratio, "a number in [0, 1)")
        _check(0 <= self.beta1 < 1, c, "beta1", self.beta1, "a number in [0, 1)")
        _check(0 <= self.beta2 < 1, c, "beta2", self.beta2, "a number in [0, 1)")
        _check(self.weight_decay >= 0, c, "weight_decay", self.weight_decay, "a number >= 0")
        _check(self.clip >= 0, c, "clip", self.clip, "a number >= 0")
        _check(self.lam is None or self.lam >= 0, c, "lam", self.lam, "None or a number >= 0")
        _check(self.router_lr_mult > 0, c, "router_lr_mult", self.router_lr_mult, "a number > 0")
        _check(self.device in ("cpu", "cuda") or self.device.startswith("cuda:"), c, "device", self.device,
               "'cpu' or 'cuda[:N]'")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
