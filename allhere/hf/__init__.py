"""Hugging Face integration: turn a loaded ``transformers`` causal LM into its AHA or DAR version in place.

Needs the ``hf`` extra: ``pip install 'allhere[hf]'``.
"""

from .._optional import require

require("transformers", "hf")

from .convert import SUPPORTED_MODEL_TYPES, collect_routing, convert, set_forced_gate  # noqa: E402
from .dar import convert_dar  # noqa: E402
from .io import load_pretrained, save_pretrained  # noqa: E402
from .sft import HFCausalLM, sft  # noqa: E402

__all__ = ["HFCausalLM", "SUPPORTED_MODEL_TYPES", "collect_routing", "convert", "convert_dar", "load_pretrained",
           "save_pretrained", "set_forced_gate", "sft"]
