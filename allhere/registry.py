"""The mechanism registry: a config's ``kind`` -> its config class and its attention module.

Every consumer -- ``ModelConfig.from_dict``, ``Decoder``, ``swap_mechanism``, the Hugging Face
conversion, evaluation, the CLI's choices -- asks here instead of listing mechanisms. A new mechanism is
one module that defines a frozen config dataclass with a ``kind`` field and an ``AttentionMechanism``
subclass, and registers them::

    @dataclass(frozen=True)
    class EveryOtherConfig:
        kind: str = field(default="every_other", init=False)

    @register(EveryOtherConfig, summary="every other key")
    class EveryOther(AttentionMechanism):
        def forward(self, q, k, v, call, cache=None): ...

The built-in mechanisms (``allhere.mechanisms``) register themselves when first needed.

``register(..., serving=Serving(...))`` says how vLLM serves the kind (``allhere.serve``, which reads it: the
plugin, ``allhere serve``'s checks and the layer installer); a kind registered without it is not served. A
masked pattern (a config with ``mask_fn``) needs only ``serving=Serving("masked")``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .validation import ConfigError

# what ``allhere.serve`` can put on a vLLM layer
INSTALLERS = ("aha", "sliding", "sinks", "dar", "dar_latent", "masked")
DEVICES = ("cpu", "cuda")  # vLLM device types


@dataclass(frozen=True)
class Serving:
    """How vLLM serves a mechanism kind (plain data: ``allhere.serve`` acts on it, this module imports no vLLM).

    installer: what goes on each converted vLLM layer: "aha" (the router and allhere's attention over the paged
    cache), "sliding" (vLLM's own sliding-window layer), "sinks" (a cache group keeping the sink and window
    blocks), "dar" (the window's cache and a latent cache), "dar_latent" (the window's cache and a cache of
    latent rows read absorbed), "masked" (allhere's attention over the paged cache
    under ``cfg.mask_fn``: any causal pattern). devices: the vLLM device types it runs on. own_cache_group:
    None, or why it keeps a KV cache group of its own (then vLLM's hybrid KV cache manager must be on).
    transformers_backend: served on the families vLLM runs through its Transformers backend. softmax_terms:
    it computes the host's learned sink logits and soft-capped scores (layers that have them are refused
    otherwise). cuda_graphs: False where vLLM must run it eagerly on a GPU (``allhere serve`` then passes
    --enforce-eager)."""

    installer: str
    devices: tuple[str, ...] = ("cpu",)
    own_cache_group: str | None = None
    transformers_backend: bool = True
    softmax_terms: bool = False
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        if self.installer not in INSTALLERS:
            raise ValueError(f"Serving.installer {self.installer!r}: expected one of {', '.join(INSTALLERS)}")
        if not self.devices or not set(self.devices) <= set(DEVICES):
            raise ValueError(f"Serving.devices {self.devices!r}: expected some of {', '.join(DEVICES)}")


@dataclass(frozen=True)
class Mechanism:
    kind: str  # the config's ``kind``
    config: type  # frozen dataclass, validated on construction
    module: type  # an ``allhere.mechanisms.base.AttentionMechanism`` subclass: module(cfg, dims)
    summary: str  # one line for --help and the docs
    serving: Serving | None = None  # how vLLM serves it (``allhere.serve``); None: not served


_REGISTRY: dict[str, Mechanism] = {}


def register(config: type, summary: str = "", serving: Serving | None = None):
    """Class decorator: register ``module`` (the decorated class) for configs of type ``config``; ``serving``:
    how vLLM serves the kind (None: not served)."""
    kind = next((f.default for f in dataclasses.fields(config) if f.name == "kind"), None)
    if not isinstance(kind, str) or not kind:
        raise TypeError(f"{config.__name__} needs a field `kind: str = field(default=..., init=False)`")
    if serving is not None and not isinstance(serving, Serving):
        raise TypeError(f"register(serving=...) takes an allhere.registry.Serving, got {serving!r}")

    def add(module: type) -> type:
        known = _REGISTRY.get(kind)
        if known is not None and (known.config.__qualname__, known.module.__qualname__) != (
                config.__qualname__, module.__qualname__):
            raise ValueError(f"mechanism kind {kind!r} is already registered by {known.module.__qualname__}")
        _REGISTRY[kind] = Mechanism(kind, config, module, summary, serving)
        return module

    return add


def _builtins() -> None:
    from . import mechanisms  # noqa: F401  (registers full, sliding, aha, dar)


def kinds() -> tuple[str, ...]:
    _builtins()
    return tuple(_REGISTRY)


def get(kind: str) -> Mechanism:
    _builtins()
    if kind not in _REGISTRY:
        raise ConfigError(f"unknown mechanism kind {kind!r}: expected one of {', '.join(_REGISTRY)}")
    return _REGISTRY[kind]


def of(cfg: Any) -> Mechanism:
    """The registered mechanism of a config object; ConfigError for anything else."""
    if not is_config(cfg):
        raise ConfigError(f"{cfg!r} is not a mechanism config of a registered kind ({', '.join(kinds())})")
    return _REGISTRY[cfg.kind]


def is_config(cfg: Any) -> bool:
    kind = getattr(cfg, "kind", None)
    return isinstance(kind, str) and kind in kinds() and isinstance(cfg, _REGISTRY[kind].config)


def build(cfg: Any, dims):
    """The attention module of ``cfg`` for a host layer of sizes ``dims`` (its own weights initialised)."""
    return of(cfg).module(cfg, dims)


def to_dict(cfg: Any) -> dict[str, Any]:
    of(cfg)
    return dataclasses.asdict(cfg)


def from_dict(d: Any):
    if not isinstance(d, dict) or not isinstance(d.get("kind"), str):
        raise ConfigError(f"a mechanism must be a JSON object with a 'kind' (one of {', '.join(kinds())}), got {d!r}")
    cls = get(d["kind"]).config
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = set(d) - known - {"kind"}
    if unknown:
        raise ConfigError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    try:
        return cls(**{k: v for k, v in d.items() if k in known})
    except TypeError as e:
        raise ConfigError(f"{cls.__name__}: {e}") from e
