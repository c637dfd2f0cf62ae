"""Save and load converted models: transformers' own safetensors files, the mechanism's settings in
config.json (``allhere_mechanism``).

``load_pretrained`` needs no ``trust_remote_code``: transformers loads the pretrained weights with its
own loader, allhere converts the model again and loads the added weights (routers or bottlenecks) from
the same files.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .. import registry
from ..hosts import CONFIG_KEY, LAYERS_KEY, SUBMODULE
from ..runtime.model_checkpoint import CheckpointError
from ..validation import ConfigError
from .convert import check_convertible, check_rope, convert
from .files import weight_files


def saved_mechanism(config):
    """The mechanism config stored in a transformers config, or None."""
    settings = getattr(config, CONFIG_KEY, None)
    return None if settings is None else registry.from_dict(settings)


def save_pretrained(model, path: str | Path, format: str = "allhere", **kwargs) -> None:
    """``model.save_pretrained`` (safetensors); the settings travel in config.json. ``format="faolmo"``: the
    AHA authors' checkpoint format instead (``allhere.hf.faolmo.save``; kwargs: ``max_shard_size`` in bytes)."""
    if format == "faolmo":  # the AHA authors' format: an OLMo-2 converted to AHA without router bias
        from .faolmo import save

        return save(model, path, **kwargs)
    if format != "allhere":
        raise ConfigError(f"format must be 'allhere' or 'faolmo', got {format!r}")
    if saved_mechanism(model.config) is None:
        raise ValueError("this model is not converted by allhere; save it with model.save_pretrained")
    model.save_pretrained(str(path), **kwargs)


def load_pretrained(path: str | Path, **kwargs):
    """Load a model saved by ``save_pretrained``: the same weights, routers or bottlenecks included.
    kwargs go to ``AutoModelForCausalLM.from_pretrained`` (dtype, device_map, ...). A folder in the AHA
    authors' format (config.json ``model_type: "faolmo"``) loads through ``allhere.hf.faolmo.load`` (kwargs:
    dtype), without its remote code."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    if not (path / "config.json").exists():
        raise CheckpointError(f"{path} is not a saved model folder (no config.json)")
    from .faolmo import load as load_faolmo
    from .faolmo import read_config as faolmo_config

    if faolmo_config(path) is not None:  # the AHA authors' format: transformers does not know model_type faolmo
        return load_faolmo(path, **kwargs)
    config = AutoConfig.from_pretrained(str(path))
    mech = saved_mechanism(config)
    if mech is None:
        raise ConfigError(f"{path} holds no allhere settings ('{CONFIG_KEY}' missing from config.json); load it "
                          "with transformers and convert it with allhere.hf.convert")
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the added weights are "unexpected" until the conversion adds them
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)  # SDPA where the family has it
    finally:
        hf_logging.set_verbosity(level)
    convert(model, mech, layers=getattr(config, LAYERS_KEY, None) or "full", host_init=False)  # weights: the files'
    wanted = {k for k in model.state_dict() if f".{SUBMODULE}." in k}
    added: dict[str, torch.Tensor] = {}
    for f in weight_files(path):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                if k in wanted:
                    added[k] = fh.get_tensor(k)
    missing = wanted - set(added)
    if missing:
        raise CheckpointError(f"{path} lacks the weights {sorted(missing)[:3]}...")
    model.load_state_dict(added, strict=False)
    return model


def _causal_lm_classes() -> set[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update((value,) if isinstance(value, str) else value)
    return names


def meta_model(config, dtype: torch.dtype | None = None):
    """The model of ``config`` on the meta device (in ``dtype`` where given), as ``from_pretrained`` builds it
    (SDPA where the family has it): its structure, no memory for weights."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, **({} if dtype is None else {"dtype": dtype}))


def load_tokenizer(path: Path, config):
    """The tokenizer of the model folder ``path`` with transformers' own loader, given its ``config`` (a faolmo
    one is not AutoConfig's to read); never the folder's own code. ConfigError when there is none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True, config=config, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} has no tokenizer transformers can load: {e}") from None


def check_causal_lm(path: str | Path, convertible: bool = False, layers="full", mechanism=None):
    """The transformers config of the model folder (or GGUF file, ``allhere.hf.gguf``) ``path``, after checking
    that it is a causal (decoder-only) LM -- and with ``convertible`` one ``allhere.hf.convert`` can convert
    (with ``mechanism`` where given, on ``layers`` as there) -- before any weight is loaded: ConfigError naming
    what it is otherwise."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from .gguf import is_gguf
    from .gguf import read_config as gguf_config

    p = Path(path)
    if is_gguf(p):
        config = gguf_config(p)  # the file checked first (truncated, an architecture transformers cannot read)
    elif not (p / "config.json").exists():
        raise ConfigError(f"model path {p} is not a saved transformers model (no config.json)"
                          + (" nor a GGUF file" if p.is_file() else ""))
    else:
        from .faolmo import olmo2_config
        from .faolmo import read_config as faolmo_config

        raw = faolmo_config(p)
        if raw is not None:  # the AHA authors' format (OLMo-2 with AHA routers), which AutoConfig does not know
            return olmo2_config(raw, f"{p}/config.json")
        try:
            config = AutoConfig.from_pretrained(str(p), local_files_only=True, trust_remote_code=False)
        except (OSError, ValueError, KeyError, TypeError) as e:  # malformed json, unknown model_type, ...
            raise ConfigError(f"{p}/config.json is not a config transformers can read: {e}") from None
    model_type = getattr(config, "model_type", None)
    architectures = list(getattr(config, "architectures", None) or [])
    what = architectures[0] if architectures else model_type
    causal = (not getattr(config, "is_encoder_decoder", False)
              and (bool(_causal_lm_classes() & set(architectures)) if architectures
                   else model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
    if not causal:
        raise ConfigError(f"{p} holds a {what} model, not a causal (decoder-only) language model")
    try:
        check_rope(config)
        saved = saved_mechanism(config)
        if saved is not None:
            check_convertible(meta_model(config), saved, getattr(config, LAYERS_KEY, None) or "full")
        elif convertible:
            check_convertible(meta_model(config), mechanism, layers)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None
    return config


def load_local(model_path: str | Path, convertible: bool = False, dtype: torch.dtype | str = "auto", layers="full"):
    """Tokenizer and model from a local folder with transformers' own loaders (never the network): a plain
    transformers causal LM (with ``convertible``, of a family allhere converts), or one saved converted (then
    through ``load_pretrained``). ``model_path`` may be a GGUF file too (``allhere.hf.gguf.load``: its weights
    de-quantized, an ordinary model). ``dtype``: "auto" keeps the dtype the weights were saved in (what
    lm-eval's ``hf`` model does; float32 for a GGUF, the de-quantized values exactly); training asks for float32."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    from .gguf import is_gguf
    from .gguf import load as load_gguf

    p = Path(model_path)
    config = check_causal_lm(p, convertible, layers)
    if is_gguf(p):
        return load_gguf(p, dtype)
    tokenizer = load_tokenizer(p, config)
    try:
        if saved_mechanism(config) is not None:
            return tokenizer, load_pretrained(p, local_files_only=True, dtype=dtype)
        return tokenizer, AutoModelForCausalLM.from_pretrained(str(p), local_files_only=True, dtype=dtype)
    except (OSError, RuntimeError, SafetensorError) as e:  # no weight file, a truncated or corrupt one, wrong shapes
        first = " ".join(str(e).split())[:300]
        raise CheckpointError(f"{p}: the weights could not be loaded ({type(e).__name__}: {first})") from e


def saved_dtype(config, path: str | Path | None = None) -> torch.dtype:
    """The dtype a model's weights were published in: config.json's ``dtype`` / ``torch_dtype``; where the
    config does not say (gpt-oss), that of the first floating-point tensor in the weight files of ``path``;
    float32 when neither tells, and for a GGUF file (its weights de-quantized: float32 holds them exactly)."""
    from .gguf import is_gguf

    if path is not None and is_gguf(path):
        return torch.float32
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if value is None and path is not None:
        from safetensors import safe_open

        with safe_open(str(weight_files(Path(path))[0]), framework="pt") as fh:
            value = next((fh.get_slice(k).get_dtype() for k in fh.keys()
                          if fh.get_slice(k).get_dtype() in ("BF16", "F16", "F32", "F64")), None)
        value = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}.get(value)
    value = value or torch.float32
    return getattr(torch, value) if isinstance(value, str) else value
