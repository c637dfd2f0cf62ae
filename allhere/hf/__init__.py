"""Hugging Face integration: turn a loaded ``transformers`` causal LM into its version with any registered
mechanism (AHA, DAR, ...) in place, save and load it, fine-tune it on chat data.

Needs the ``hf`` extra: ``pip install 'allhere[hf]'``.
"""

from .._optional import require

require("transformers", "hf")

from ..routing import set_forced_gate  # noqa: E402
from .cache import cache_nbytes, new_cache  # noqa: E402
from .convert import attention_layers, collect_routing, convert, converted_mechanism, global_share  # noqa: E402
from .io import load_pretrained, save_pretrained  # noqa: E402
from .causal_lm import HFCausalLM  # noqa: E402
from .sft import sft  # noqa: E402

__all__ = ["HFCausalLM", "attention_layers", "cache_nbytes", "collect_routing", "convert", "converted_mechanism", "global_share",
           "load_pretrained", "new_cache", "save_pretrained", "set_forced_gate", "sft"]


def __getattr__(name):
    if name == "SUPPORTED_MODEL_TYPES":  # deprecated (allhere.hf.convert says why)
        import importlib

        return importlib.import_module(".convert", __name__).__getattr__(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
