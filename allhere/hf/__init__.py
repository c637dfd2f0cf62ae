"""Hugging Face integration: turn a loaded ``transformers`` causal LM into its version with any registered
mechanism (AHA, DAR, ...) in place, save and load it, fine-tune it on chat data. ``allhere.set_forced_gate``
and ``allhere.routed_layers`` work on converted models as on allhere's own decoder.

Needs the ``hf`` extra: ``pip install 'allhere[hf]'``.
"""

from .._optional import require

require("transformers", "hf")

from .._deprecated import moved_names  # noqa: E402
from .cache import cache_nbytes, new_cache  # noqa: E402
from .causal_lm import HFCausalLM  # noqa: E402
from .convert import attention_layers, collect_routing, convert, converted_mechanism, global_share  # noqa: E402
from .io import load_pretrained, save_pretrained  # noqa: E402
from .sft import sft  # noqa: E402

__all__ = ["HFCausalLM", "attention_layers", "cache_nbytes", "collect_routing", "convert", "converted_mechanism",
           "global_share", "load_pretrained", "new_cache", "save_pretrained", "sft"]

__getattr__ = moved_names(__name__, {"set_forced_gate": ("allhere", "set_forced_gate")})
