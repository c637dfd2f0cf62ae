"""The AHA authors' checkpoint format ("faolmo", ``FAOlmoForCausalLM``), read and written without its
remote code.

"Learning When Not to Attend Globally" (Luo, Zhang, Yan) released an OLMo-2 with All-or-Here routers in
this format. A folder holds OLMo-2's config fields and weight names, with ``model_type: "faolmo"``,
``architectures: ["FAOlmoForCausalLM"]`` and ``local_window_size`` (default 128) in config.json, and one
difference in the weights: each layer's ``model.layers.N.self_attn.q_proj.weight`` is [H*D + H, hidden]:

- rows [0, H*D): OLMo-2's query projection (q_norm normalises these H*D outputs, over all heads);
- rows [H*D, H*D + H): the router W_r^T, one row per head, no bias. A (token, head) reads the whole
  prefix when sigmoid(x W_r) > 0.5, else its ``local_window_size`` most recent keys (itself included);
  x is the attention module's input, OLMo-2 being post-norm: the raw residual stream.

head_dim = hidden_size / num_attention_heads; q/k/v/o have no bias; RoPE (``rope_theta``,
``rope_scaling`` / ``rope_parameters``) and ``rms_norm_eps`` as OLMo-2.

In allhere that model is transformers' ``Olmo2ForCausalLM`` converted with ``AHAConfig(window=
local_window_size, tau=0.5, router="linear", router_bias=False)``: the router rows are each layer's
``self_attn.allhere.router.weight`` [H, hidden]. ``load`` builds it, ``save`` writes such a model back.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from .. import registry
from ..hosts import CONFIG_KEY, SUBMODULE
from ..mechanisms.aha import AHAConfig
from ..runtime.model_checkpoint import CheckpointError
from ..validation import ConfigError
from .convert import attention_layers, check_rope, convert, converted_mechanism
from .files import weight_files

MODEL_TYPE = "faolmo"
ARCHITECTURE = "FAOlmoForCausalLM"
DEFAULT_WINDOW = 128  # local_window_size when config.json does not give it
TAU = 0.5  # the format's gate: sigmoid(logit) > 0.5
KEPT_KEY = "faolmo_fields"  # config attribute: the faolmo-only fields of a loaded folder, written back by save
KEPT = ("auto_map", "attention_implementation")  # the authors' remote code and their serving kernel choice
NOT_OLMO2 = {"model_type", "architectures", "local_window_size", "transformers_version", "torch_dtype", "dtype",
             "head_dim", "rope_theta", "rope_scaling", "rope_parameters", *KEPT}
Q_PROJ = re.compile(r"(model\.layers\.\d+\.self_attn)\.q_proj\.weight")
SHARD_BYTES = 5 * 2**30  # the largest weight file save writes before sharding (transformers' default)


def read_config(path: str | Path) -> dict | None:
    """config.json of the folder ``path`` when it is a faolmo checkpoint (``model_type: "faolmo"``), else None."""
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) and raw.get("model_type") == MODEL_TYPE else None


def mechanism(window: int) -> AHAConfig:
    """The allhere mechanism the format expresses."""
    return AHAConfig(window=window, tau=TAU, router="linear", router_bias=False)


def olmo2_config(raw: dict, where: str = "config.json"):
    """transformers' ``Olmo2Config`` of a faolmo config.json (dict), carrying its AHA settings as a
    converted model's config does (``saved_mechanism`` reads them). ConfigError, one line, for a field the
    format does not define the model with."""
    from transformers import Olmo2Config

    try:
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{where}: a faolmo config needs hidden_size and num_attention_heads ({e!r})") from None
    if heads < 1 or hidden % heads:
        raise ConfigError(f"{where}: hidden_size = {hidden} is not a multiple of num_attention_heads = {heads} "
                          "(the faolmo format's head_dim is hidden_size / num_attention_heads)")
    if raw.get("head_dim") not in (None, hidden // heads):
        raise ConfigError(f"{where}: head_dim = {raw['head_dim']}; the faolmo format's head_dim is hidden_size / "
                          f"num_attention_heads = {hidden // heads}")
    if raw.get("attention_bias"):
        raise ConfigError(f"{where}: attention_bias = true; the faolmo format's projections have no bias")
    window = raw.get("local_window_size", DEFAULT_WINDOW)
    mech = mechanism(window)  # ConfigError naming AHAConfig.window for a bad local_window_size
    # rope_scaling first, then rope_parameters, rope_theta beside them: as the format's config class reads them
    rope = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {"rope_type": "default"})
    if "type" in rope:
        rope["rope_type"] = rope.pop("type")
    rope.setdefault("rope_theta", raw.get("rope_theta", 500000.0))
    try:
        config = Olmo2Config(**{k: v for k, v in raw.items() if k not in NOT_OLMO2}, rope_parameters=rope,
                             dtype=raw.get("dtype") or raw.get("torch_dtype"))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: not an OLMo-2 configuration transformers can build ({e})") from None
    config.architectures = ["Olmo2ForCausalLM"]
    kept = {k: raw[k] for k in KEPT if k in raw}
    if kept:
        setattr(config, KEPT_KEY, kept)
    try:
        check_rope(config)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    setattr(config, CONFIG_KEY, registry.to_dict(mech))
    return config


def load(path: str | Path, dtype: torch.dtype | str = "auto", local_files_only: bool = True):
    """The faolmo checkpoint in folder ``path`` as an OLMo-2 converted to AHA (module docstring), in eval
    mode. ``dtype``: "auto" keeps the dtype of the saved weights. Only local files are read
    (``local_files_only`` is accepted for ``load_pretrained``'s callers and always holds), no code of the
    folder runs. Weight names carry the ``model.`` prefix, as the format has them; tensors the model has no
    place for (rotary ``inv_freq`` buffers) are skipped, as the format's other loaders skip them."""
    from safetensors import safe_open
    from transformers import GenerationConfig, Olmo2ForCausalLM
    from transformers.initialization import no_init_weights

    path = Path(path)
    raw = read_config(path)
    if raw is None:
        raise ConfigError(f"{path} is not a faolmo checkpoint (config.json model_type is not {MODEL_TYPE!r})")
    config = olmo2_config(raw, f"{path}/config.json")
    mech = registry.from_dict(getattr(config, CONFIG_KEY))
    rows = config.hidden_size  # H * D query rows, then H router rows
    tensors, routers = {}, {}
    for f in weight_files(path):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                tensors[name] = fh.get_tensor(name)
    for name in [n for n in tensors if Q_PROJ.fullmatch(n)]:
        w = tensors[name]
        if w.shape != (rows + config.num_attention_heads, config.hidden_size):
            raise CheckpointError(f"{path}: {name} is {list(w.shape)}; the faolmo format has [H*D + H, hidden] = "
                                  f"[{rows + config.num_attention_heads}, {config.hidden_size}]")
        tensors[name], routers[Q_PROJ.fullmatch(name)[1]] = w[:rows], w[rows:]
    if dtype == "auto":
        dtype = config.dtype or tensors.get("model.embed_tokens.weight", torch.empty(0)).dtype
    with no_init_weights():  # every weight comes from the files
        model = Olmo2ForCausalLM._from_config(config, dtype=dtype, attn_implementation="sdpa")
    expected = set(model.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing = sorted(expected - set(tensors))
    if missing:
        raise CheckpointError(f"{path}: the faolmo checkpoint lacks {len(missing)} weight(s): "
                              f"{', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}")
    try:
        model.load_state_dict({k: tensors[k] for k in expected}, strict=False)
    except RuntimeError as e:  # a shape that does not match the config
        first = " ".join(str(e).split())[:300]
        raise CheckpointError(f"{path}: the faolmo weights do not fit its config.json ({first})") from None
    model.tie_weights()  # tie_word_embeddings: lm_head is the embedding (transformers ties on load)
    if (path / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(str(path), local_files_only=True)
    convert(model, mech)
    with torch.no_grad():
        for name, attn in model.named_modules():
            if hasattr(attn, SUBMODULE):
                getattr(attn, SUBMODULE).router.weight.copy_(routers[name])
    return model.eval()


def check_mechanism(mech) -> None:
    """ConfigError, one line, for a mechanism config the faolmo format cannot express: not AHA, tau != 0.5,
    a router with a bias, or not the linear router."""
    if getattr(mech, "kind", None) != "aha":
        raise ConfigError(f"the faolmo format holds AHA routers; {type(mech).__name__} ({mech.kind}) cannot be "
                          "written in it")
    if mech.tau != TAU:
        raise ConfigError(f"AHAConfig.tau = {mech.tau}: the faolmo format's gate is sigmoid(logit) > {TAU}; "
                          f"convert with tau={TAU}")
    if mech.router_bias:
        raise ConfigError("AHAConfig.router_bias = True: the faolmo format's router has no bias; convert (and "
                          "fine-tune) with AHAConfig(router_bias=False)")
    if mech.router != "linear":
        raise ConfigError(f"AHAConfig.router = {mech.router!r}: the faolmo format is written from router='linear'")


def check_expressible(model) -> AHAConfig:
    """The AHA settings of ``model`` when the faolmo format can hold it; ConfigError, one line, otherwise:
    not an OLMo-2 converted by allhere to AHA on every layer with one setting, tau = 0.5, a router without
    bias, head_dim = hidden / heads, no attention bias."""
    config = model.config
    kind = getattr(config, "model_type", None)
    if kind != "olmo2":
        raise ConfigError(f"the faolmo format holds OLMo-2 models (model_type 'olmo2'); this is {kind!r}")
    mech = converted_mechanism(model)
    if mech is None:
        raise ConfigError("this OLMo-2 is not converted: the faolmo format holds AHA routers; convert it with "
                          "allhere.hf.convert(model, AHAConfig(window=..., router_bias=False))")
    check_mechanism(mech)
    heads, hidden = config.num_attention_heads, config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    if head_dim * heads != hidden:
        raise ConfigError(f"head_dim = {head_dim} with {heads} heads is not hidden_size / heads = {hidden / heads:g}; "
                          "the faolmo format derives head_dim from hidden_size")
    if getattr(config, "attention_bias", False):
        raise ConfigError("attention_bias = True: the faolmo format's projections have no bias")
    for index, attn in attention_layers(model):
        mine = getattr(attn, SUBMODULE, None)
        if mine is None:
            raise ConfigError(f"layer {index} has no AHA router; the faolmo format routes every layer "
                              "(convert all layers)")
        check_mechanism(mine.cfg)
        if mine.cfg.window != mech.window:
            raise ConfigError(f"layer {index} has its own window ({mine.cfg.window}, the model's is {mech.window}); "
                              "the faolmo format has one local_window_size for every layer")
    return mech


def config_dict(model, mech: AHAConfig) -> dict:
    """config.json of the faolmo folder: OLMo-2's fields as published, the format's own, and the faolmo-only
    fields the model was loaded with (``auto_map``, ``attention_implementation``)."""
    c = model.config
    rope = dict(getattr(c, "rope_parameters", None) or {})
    theta = rope.pop("rope_theta", getattr(c, "rope_theta", 10000.0))
    fields = ("attention_dropout", "bos_token_id", "eos_token_id", "hidden_act", "hidden_size", "initializer_range",
              "intermediate_size", "max_position_embeddings", "num_attention_heads", "num_hidden_layers",
              "num_key_value_heads", "pad_token_id", "rms_norm_eps", "tie_word_embeddings", "use_cache", "vocab_size")
    out = {k: getattr(c, k) for k in fields if hasattr(c, k)}
    out.update(getattr(c, KEPT_KEY, None) or {})
    out.update(architectures=[ARCHITECTURE], model_type=MODEL_TYPE, attention_bias=False,
               local_window_size=mech.window, rope_theta=theta,
               rope_scaling=None if rope.get("rope_type", "default") == "default" else rope,
               torch_dtype=str(model.dtype).removeprefix("torch."))
    return dict(sorted(out.items()))


def state_dict(model) -> dict[str, torch.Tensor]:
    """The faolmo tensors of an expressible model: its OLMo-2 weights, each q_proj [H*D, hidden] with the
    layer's router [H, hidden] appended as rows (in q_proj's dtype); lm_head left out when tied."""
    state = {k: v for k, v in model.state_dict().items() if f".{SUBMODULE}." not in k}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for name, attn in model.named_modules():
        if hasattr(attn, SUBMODULE):
            q = attn.q_proj.weight
            state[f"{name}.q_proj.weight"] = torch.cat([q, getattr(attn, SUBMODULE).router.weight.to(q.dtype)])
    return {k: v.detach().cpu().contiguous() for k, v in state.items()}


def _write(path: Path, name: str, write) -> None:
    tmp = path / f".{name}.tmp"
    write(tmp)
    os.replace(tmp, path / name)


def save(model, path: str | Path, max_shard_size: int = SHARD_BYTES) -> None:
    """Write ``model`` (an OLMo-2 converted to AHA, see ``check_expressible``) as a faolmo folder: config.json,
    generation_config.json, model.safetensors -- or shards of at most ``max_shard_size`` bytes with
    model.safetensors.index.json -- each file written atomically. Nothing is written when the model is
    refused."""
    from safetensors.torch import save_file

    mech = check_expressible(model)
    tensors = state_dict(model)
    config = config_dict(model, mech)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for old in [*path.glob("model*.safetensors"), path / "model.safetensors.index.json"]:  # an earlier save's
        old.unlink(missing_ok=True)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for name, shard in zip(names, shards):
        _write(path, name, lambda f, shard=shard: save_file(shard, str(f), metadata={"format": "pt"}))
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {k: n for n, shard in zip(names, shards) for k in shard}}
        _write(path, "model.safetensors.index.json", lambda f: f.write_text(json.dumps(index, indent=2) + "\n"))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(str(path))
    _write(path, "config.json", lambda f: f.write_text(json.dumps(config, indent=2) + "\n"))
