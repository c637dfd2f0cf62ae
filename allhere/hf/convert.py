"""Convert a loaded ``transformers`` causal LM to any registered mechanism, in place: every pretrained
weight kept, the mechanism's own weights (routers, bottlenecks) added.

Extension points only, no patched ``forward``: each converted attention module gets the mechanism as its
``allhere`` submodule and a forward pre-hook that hands it the call; the model switches to the attention
function and mask function registered under ``allhere`` (``allhere.hf.attention``), which run the layers
left as they were with the attention function the model had.

Any decoder whose attention modules go through transformers' attention interface converts: its layers
are found through the model's own structure (``attention_layers``), not a table of families. Layers keep
what they are: a hybrid model's sliding-window layers (``config.layer_types``: Gemma-2/3, OLMo-3, gpt-oss,
Cohere2, Qwen2's ``max_window_layers``) stay as they were, with their window, their RoPE and their cache,
and the mechanism goes on the full-attention layers (``layers="full"``, the default).
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Sequence
from functools import cache, partial

import torch

from .. import registry
from ..hosts import CONFIG_KEY, LAYERS_KEY, SUBMODULE
from ..mechanisms.base import AttentionDims, mechanism_layers
from ..routing import Routing, routed_layers
from ..validation import ConfigError
from .attention import ATTN_NAME, HOST_IMPL, register, stash_call, unwrap_generate_masks
from .cache import has_own_layer

KINDS_KEY = "allhere_original_layer_types"  # config.json entry: the layer types before windows were replaced
LAYER_CHOICES = ("full", "all")
FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' names in config.layer_types
LENGTH_DEPENDENT_ROPE = {"dynamic", "longrope"}  # rotary frequencies that change with the sequence length


@cache
def _calls_attention_interface(cls) -> bool:
    """Whether ``cls.forward`` dispatches to transformers' attention interface (``ALL_ATTENTION_FUNCTIONS``)."""
    forward = getattr(cls, "forward", None)
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in source


def attention_layers(model) -> list[tuple[int, torch.nn.Module]]:
    """(layer index, attention module) of every decoder layer of a transformers causal LM, in layer order:
    the modules whose forward calls transformers' attention interface, numbered by their ``layer_idx``.
    ConfigError (one line) when the model has none, or they do not number the layers 0..L-1 once each."""
    what = type(model).__name__
    if model.config.get_text_config() is not model.config:
        raise ConfigError(f"{what} is a multimodal model; allhere converts language models: load its text "
                          "decoder alone (e.g. Gemma3ForCausalLM from its text_config)")
    found = [m for m in model.modules() if _calls_attention_interface(type(m))]
    if not found:
        raise ConfigError(f"{what}: no attention module calls transformers' attention interface "
                          "(ALL_ATTENTION_FUNCTIONS); allhere converts decoders whose attention does")
    indices = [getattr(m, "layer_idx", None) for m in found]
    layers = getattr(model.config, "num_hidden_layers", len(found))
    if sorted(i for i in indices if isinstance(i, int)) != list(range(layers)) or None in indices:
        raise ConfigError(f"{what}: its {len(found)} attention modules ({type(found[0]).__name__}) do not carry the "
                          f"layer indices 0..{layers - 1} (layer_idx), so allhere cannot tell its layers apart")
    return sorted(zip(indices, found), key=lambda pair: pair[0])


def attention_modules(model) -> list[torch.nn.Module]:
    """The attention module of every decoder layer, in layer order."""
    return [attn for _, attn in attention_layers(model)]


def layer_kinds(config) -> list[str]:
    """Per decoder layer, transformers' attention type: ``config.layer_types`` where the model has it; else
    every layer sliding when ``config.sliding_window`` is shorter than the context (Mistral-7B-v0.1), full
    otherwise."""
    kinds = getattr(config, "layer_types", None)
    if kinds:
        return list(kinds)
    window = getattr(config, "sliding_window", None)
    context = getattr(config, "max_position_embeddings", None)
    local = window is not None and (context is None or window < context) and getattr(config, "use_sliding_window", True)
    return [SLIDING if local else FULL] * config.num_hidden_layers


def _rope_per_layer_type(config) -> bool:
    params = getattr(config, "rope_parameters", None) or {}
    return bool(params) and all(isinstance(v, dict) for v in params.values())


def chosen_layers(config, layers: str | Sequence[int] = "full") -> list[int]:
    """The indices of the layers the mechanism goes on: ``"full"`` the full-attention layers, ``"all"``
    every layer, or explicit indices. A sliding window the mechanism replaces (its global attention reads
    the whole prefix) can only be the one window of a model without ``layer_types`` (Mistral-7B-v0.1), on
    all of its layers. ConfigError for a choice the model cannot take."""
    kinds = layer_kinds(config)
    unknown = sorted({k for k in kinds if k not in (FULL, SLIDING)})
    if unknown:
        at = kinds.index(unknown[0])
        raise ConfigError(f"config.json: layer_types has {unknown[0]!r} (layer {at}); allhere knows "
                          f"{FULL!r} and {SLIDING!r} layers")
    indices = isinstance(layers, (list, tuple, range)) and all(isinstance(i, int) for i in layers)
    if layers not in LAYER_CHOICES and not indices:
        raise ConfigError(f"layers must be one of {LAYER_CHOICES} or a list of layer indices, got {layers!r}")
    if not indices:
        chosen = [i for i, k in enumerate(kinds) if layers == "all" or k == FULL]
        if not chosen and getattr(config, "layer_types", None):
            raise ConfigError("every layer of config.layer_types is a sliding-window layer: none can take a "
                              "mechanism (their masks, caches and RoPE follow that list)")
        if not chosen:
            raise ConfigError(f"every layer of this model attends within a sliding window of "
                              f"{getattr(config, 'sliding_window', None)} tokens (no full-attention layer to "
                              "convert); layers='all' (--layers all) puts the mechanism on them in place of the window")
    else:
        chosen = sorted(set(layers))
        bad = [i for i in chosen if not 0 <= i < len(kinds)]
        if bad or not chosen:
            raise ConfigError(f"layers: {bad or 'none'} is not a list of layer indices 0..{len(kinds) - 1}")
    replaced = [i for i in chosen if kinds[i] == SLIDING]
    if replaced and getattr(config, "layer_types", None):
        raise ConfigError(f"layer {replaced[0]} is a sliding-window layer of config.layer_types; its mask, cache and "
                          "(in some families) RoPE follow that list, so allhere puts mechanisms on such a model's "
                          "full-attention layers only (layers='full')")
    if replaced and len(chosen) != len(kinds):
        raise ConfigError(f"this model's sliding window ({config.sliding_window}) is one setting of every layer; "
                          "convert all of its layers or none")
    return chosen


def rotary_module(model):
    """The model's rotary embedding module (the first ``rotary_emb`` outside the decoder layers), or None."""
    return next((m for name, m in model.named_modules() if name.rpartition(".")[2] == "rotary_emb"), None)


def _rotary_for(model, index: int):
    """The rotary embedding of layer ``index`` as ``rotary(x, position_ids)``: the model's rotary module,
    told the layer type where it keeps one RoPE per type (Gemma-3, OLMo-3)."""
    rotary = rotary_module(model)
    if rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters:
        return partial(rotary, layer_type=layer_kinds(model.config)[index])
    return rotary


def dims_of(config) -> AttentionDims:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return AttentionDims(config.hidden_size, heads, getattr(config, "num_key_value_heads", None) or heads, head_dim)


def rope_types(config) -> set[str]:
    """The rotary types a transformers config asks for (one per layer type where it has several)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    groups = params.values() if _rope_per_layer_type(config) else [params]
    return {g.get("rope_type", g.get("type", "default")) or "default" for g in groups}


def check_rope(config) -> None:
    """Refuse (ConfigError) a rotary type transformers does not implement: the model could not be built."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    unknown = sorted(t for t in rope_types(config) if t != "default" and t not in ROPE_INIT_FUNCTIONS)
    if unknown:
        raise ConfigError(f"config.json asks for rope_type {', '.join(map(repr, unknown))}, which this transformers "
                          f"does not implement (it knows default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))})")


def softmax_extras(attn) -> list[str]:
    """What a layer's softmax has besides scaled scores: gpt-oss's learned sink logit per head, Gemma-2's
    soft-capping of the scores."""
    extras = []
    if isinstance(getattr(attn, "sinks", None), torch.Tensor):
        extras.append("a learned attention-sink logit per head (self_attn.sinks)")
    if getattr(attn, "attn_logit_softcapping", None) is not None:
        extras.append(f"soft-capped attention scores (attn_logit_softcapping = {attn.attn_logit_softcapping})")
    return extras


def check_convertible(model, cfg=None, layers: str | Sequence[int] = "full") -> list[int]:
    """The layers ``convert`` would put mechanism ``cfg`` on; ConfigError (one line naming the flag) for what
    it would compute differently from the original: attention outside transformers' attention interface, an
    unknown layer type or rope type, a layer whose softmax has a term the mechanism does not compute (sinks,
    soft-capping), and for a mechanism that rebuilds keys of earlier tokens at their own positions (DAR's
    compressed cache) a rotary embedding whose frequencies change with the sequence length. ``model`` may
    live on the meta device."""
    config = model.config
    check_rope(config)
    found = attention_layers(model)
    v_dim = getattr(config, "v_head_dim", None)
    if v_dim is not None and v_dim != dims_of(config).head_dim:
        raise ConfigError(f"config.json: v_head_dim = {v_dim} differs from the query/key head_dim "
                          f"{dims_of(config).head_dim} (multi-head latent attention); allhere's attention takes "
                          "values of the keys' width")
    chosen = chosen_layers(config, layers)
    if cfg is None:
        return chosen
    name = type(cfg).__name__
    module = registry.of(cfg).module
    for index, attn in found:
        extras = softmax_extras(attn) if index in chosen and not module.host_softmax else []
        if extras:
            raise ConfigError(f"layer {index} has {extras[0]}, which {name} does not compute; AHA does "
                              "(--mechanism aha)")
    if has_own_layer(module, cfg.kind):
        dynamic = rope_types(config) & LENGTH_DEPENDENT_ROPE
        if dynamic:
            raise ConfigError(f"config.json: rope_type {dynamic.pop()!r} changes the rotary frequencies with the "
                              f"sequence length; {name} rebuilds earlier keys at their own positions "
                              "and would rotate them with other frequencies than the original did")
    return chosen


def _check_window(model, cfg) -> None:
    window = getattr(cfg, "window", None)
    context = getattr(model.config, "max_position_embeddings", None)
    if window is not None and context is not None and window > context:
        raise ConfigError(f"{type(cfg).__name__}.window = {window} is larger than the model's context "
                          f"(max_position_embeddings = {context})")


def _host_implementation(model) -> str:
    """The attention function the layers left as they were keep running: eager where the model ran eager,
    else SDPA (and the eager one wherever a layer's softmax has sinks or soft-capping, ``host_attention``)."""
    impl = getattr(model.config, "_attn_implementation", None)
    if impl == ATTN_NAME:
        raise ValueError("this model is already converted (its attention implementation is allhere's)")
    return "eager" if impl == "eager" else "sdpa"


def _replace_windows(config, chosen: list[int]) -> None:
    """A model whose every layer has the one ``sliding_window`` of its config (Mistral-7B-v0.1), converted on
    every layer: its masks, caches and config.json say full attention from now on (``chosen_layers`` refuses
    the rest)."""
    kinds = layer_kinds(config)
    if any(kinds[i] == SLIDING for i in chosen):
        setattr(config, KINDS_KEY, kinds)
        config.sliding_window = None
        if getattr(config, "use_sliding_window", False):
            config.use_sliding_window = False


def conversion_notes(config, layers: str | Sequence[int] = "full") -> list[str]:
    """What a user should know of a conversion on ``layers`` that changes more than the attention pattern: a
    sliding window replaced by the mechanism, attention dropout switched off."""
    kinds = layer_kinds(config)
    chosen = chosen_layers(config, layers)
    notes = []
    replaced = [i for i in chosen if kinds[i] == SLIDING]
    if replaced:
        notes.append(f"note: {len(replaced)} layer(s) had a sliding window of {config.sliding_window} tokens, "
                     "replaced by the mechanism: their global attention reads the whole prefix")
    dropout = getattr(config, "attention_dropout", None) or getattr(config, "attn_pdrop", None)
    if dropout:
        notes.append(f"note: attention dropout ({dropout}) is off on the converted layers (allhere's attention has "
                     "none); the rest of the model trains as before")
    return notes


def convert(model, cfg, layers: str | Sequence[int] = "full", seed: int | None = None,
            calibration: torch.Tensor | None = None, host_init: bool = True):
    """Turn ``model`` (a transformers causal LM whose attention goes through transformers' attention
    interface) into its version with mechanism ``cfg`` (any registered config: ``AHAConfig``,
    ``DARConfig``, ...), in place; returns the model.

    ``layers``: ``"full"`` (default) puts the mechanism on the full-attention layers and leaves a hybrid
    model's sliding-window layers as they are; ``"all"`` on every layer (Mistral-7B-v0.1's window, the one
    setting of all its layers, is then replaced: global attention reads the whole prefix); or a list of
    layer indices (``chosen_layers``). The layers left as they were run the attention function the model
    had (SDPA, or the family's eager one for sinks and soft-capping). Where a layer's softmax has sink
    logits (gpt-oss) or soft-capped scores (Gemma-2), a mechanism must compute them (``host_softmax``: AHA
    attends through the host's own eager function, densely) or it is refused. Attention dropout is off on
    the converted layers (allhere's attention has none).

    The mechanism's own weights start as it initialises them: AHA's "global" router init (the default)
    and DAR's orthonormal bottleneck with d_down = d make the converted model compute what the original
    computed. ``seed``: None draws any random part of that initialisation from the global generator (as
    ever); an int initialises layer i's mechanism from its own seed ``layer_seed(seed, i)`` alone
    (``init_mechanism``), whatever ran before: what a sharded load (``allhere.hf.sharded_load``) gives.

    A mechanism that initialises from the host's pretrained weights (``has_host_init``: ``dar_latent``'s
    latent, MHA2MLA's recipe) is then set from them (``host_init``, the default): with ``calibration``
    (token ids [b, n], forwarded one row at a time without a cache) it chooses what it keeps from the host's
    own activations, else it takes its documented data-free choice. A host layer it cannot read is refused
    in one line before anything changes; so is a model on the meta device (no weights to read yet: convert
    the loaded model). ``host_init=False`` keeps the mechanism's fresh initialisation (training from
    scratch, or weights loaded afterwards).

    KV cache: transformers' own (every key kept; a sliding layer's rolling one) for mechanisms that decode
    with it; a mechanism with its own cache layer (``allhere.hf.cache.has_own_layer``: DAR's compressed
    cache) gets it inside transformers' Cache (``allhere.hf.cache``), ``generate`` included; ``use_cache`` is
    switched off only for a mechanism that has neither.
    """
    entry = registry.of(cfg)
    found = attention_layers(model)
    if any(hasattr(attn, SUBMODULE) for _, attn in found):
        raise ValueError("this model is already converted (its attention modules hold allhere mechanisms)")
    chosen = check_convertible(model, cfg, layers)
    _check_window(model, cfg)
    host_init = host_init and entry.module.has_host_init()
    if host_init:
        _check_host_init(model, entry.module, cfg, dict(found), chosen)
    elif calibration is not None:
        raise ValueError(f"calibration is for mechanisms initialised from the host; {type(cfg).__name__} is not"
                         + (" (host_init=False)" if entry.module.has_host_init() else ""))
    dims = dims_of(model.config)
    built = {i: entry.module(cfg, dims) for i in chosen}
    if seed is not None:
        for i, mech in built.items():
            init_mechanism(mech, seed, i)
    first = built[chosen[0]]
    if not entry.module.hf_support or first.q_extra_rows is not None:
        raise ConfigError(f"mechanism {cfg!r} cannot live in a Hugging Face attention module"
                          + (" (router='qproj' would change q_proj's shape; use router='linear')"
                             if first.q_extra_rows is not None else ""))
    host = _host_implementation(model)
    register()
    for index, attn in found:
        setattr(attn, HOST_IMPL, host)
        mech = built.get(index)
        if mech is None:
            continue
        ref = next(attn.parameters())
        mech.to(device=ref.device, dtype=ref.dtype)
        mech.hf_call = mech.hf_captured = mech.last_routing = None
        mech.layer_index = index  # the model's layer number (a hybrid's converted layers are not 0..n-1)
        attn.add_module(SUBMODULE, mech)
        # K/V at other positions (DAR) need the layer's rotary embedding
        attn.register_forward_pre_hook(partial(stash_call, rotary=_rotary_for(model, index)), with_kwargs=True)
    config = model.config
    _replace_windows(config, chosen)
    if not entry.module.hf_cache and not has_own_layer(entry.module, cfg.kind):  # no cache it could use
        config.use_cache = False
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.use_cache = False
    setattr(config, CONFIG_KEY, registry.to_dict(cfg))
    setattr(config, LAYERS_KEY, chosen)
    model.set_attn_implementation(ATTN_NAME)
    unwrap_generate_masks(model)
    if host_init:
        entry.module.init_from_host(model, None if calibration is None else partial(_calibrate, model, calibration))
    return model


def _check_host_init(model, module, cfg, attns: dict, chosen: list[int]) -> None:
    """ConfigError (one line) where ``module`` cannot initialise from the host: weights on the meta device, or a
    host layer it cannot read."""
    name = type(cfg).__name__
    if any(p.is_meta for p in model.parameters()):
        raise ConfigError(f"{name} initialises from the host's pretrained weights, and this model is on the meta "
                          "device (none loaded yet): convert the loaded model, or pass host_init=False and set the "
                          "mechanism's weights afterwards")
    for index in chosen:
        refusal = module.host_init_refusal(attns[index])
        if refusal:
            raise ConfigError(f"layer {index}: {refusal}; convert with host_init=False to keep {name}'s fresh "
                              "initialisation (training from scratch)")


def _calibrate(model, ids: torch.Tensor) -> None:
    """Forward ``ids`` [b, n] through ``model`` one row at a time, without a cache, in eval mode."""
    if ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"calibration must be integer token ids [b, n]; got {ids.dtype} {list(ids.shape)}")
    device, training = next(model.parameters()).device, model.training
    model.eval()
    try:
        for row in ids.split(1):
            model(row.to(device), use_cache=False)
    finally:
        model.train(training)


def layer_seed(seed: int, index: int) -> int:
    """The seed of layer ``index``'s mechanism in a conversion with ``seed``: a hash of both, so layers and
    seeds draw unrelated numbers."""
    digest = hashlib.sha256(f"allhere-mechanism:{int(seed)}:{int(index)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def init_mechanism(mech: torch.nn.Module, seed: int, index: int) -> torch.nn.Module:
    """Initialise ``mech`` (on the CPU, before it is cast or moved) as layer ``index`` of a conversion with
    ``seed``, from that seed alone (the global generator is left as it was): every submodule's own
    ``reset_parameters`` (an ``nn.Linear``'s default init), then the mechanism's. A parameter neither sets
    (still NaN, as it is filled first) is an error: it would differ from one process to the next."""
    params = dict(mech.named_parameters())
    if any(p.device.type != "cpu" for p in params.values()):
        raise ValueError("init_mechanism initialises a mechanism on the CPU, before it is moved")
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(layer_seed(seed, index))
        for p in params.values():
            p.fill_(float("nan"))
        for sub in mech.modules():
            reset = getattr(sub, "reset_parameters", None)
            if sub is not mech and callable(reset):
                reset()
        mech.reset_parameters()
    unset = [name for name, p in params.items() if p.is_floating_point() and bool(p.isnan().any())]
    if unset:
        raise ValueError(f"{type(mech).__name__}.reset_parameters leaves {unset[0]} unset; a seeded conversion "
                         "needs every mechanism weight initialised there")
    return mech


def converted_mechanism(model):
    """The mechanism config a converted model carries (its config.json settings), or None."""
    settings = getattr(model.config, CONFIG_KEY, None)
    return None if settings is None else registry.from_dict(settings)


def collect_routing(model) -> Routing:
    """The routing of the model's last forward pass (scores and gates of every routed layer)."""
    layers = routed_layers(model)
    if not layers or not mechanism_layers(model):
        raise ValueError("this model has no routed layers: convert it with allhere.hf.convert and an AHAConfig")
    return Routing([i for i, _ in layers], [m.last_routing for _, m in layers])


def global_share(model, mu_f: float | None = None) -> dict[str, float]:
    """Of all (layer, head, token) triples, the share that read the whole prefix: ``"before"`` as the
    original model had its layers (full layers 1, sliding layers 0), ``"after"`` with the mechanisms (the
    routed layers at ``mu_f``, by default their mean over the model's last forward pass; a mechanism that
    reads every key 1, one that does not 0; layers left as they were as before). Gemma-3 (5 sliding : 1
    full) is 1/6 before and mu_f / 6 after AHA on its full layer."""
    kinds = getattr(model.config, KINDS_KEY, None) or layer_kinds(model.config)
    mechs = {m.layer_index: m for m in mechanism_layers(model)}
    routed = [i for i, m in mechs.items() if m.routed]
    if routed and mu_f is None:
        if any(mechs[i].last_routing is None for i in routed):
            raise ValueError("global_share: run a forward pass first, or pass mu_f")
        mu_f = float(collect_routing(model).mu_f())
    static = sum(float(bool(mechs[i].reads_all_keys)) if i in mechs else float(kind == FULL)
                 for i, kind in enumerate(kinds) if i not in routed)
    after = static + (len(routed) * mu_f if routed else 0.0)
    return {"before": sum(k == FULL for k in kinds) / len(kinds), "after": after / len(kinds)}
