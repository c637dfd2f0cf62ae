"""All-or-Here attention ("Learning When Not to Attend Globally"): ``aha_attention`` is the entry point.

``aha_attention_naive`` is the dense fp32 reference (backend "reference"); ``aha_attention_fast`` is
``aha_attention`` never on the reference, with the PyTorch path's tuning knobs. Modules: ``dispatch``
(the routing), ``naive``, ``fast`` (the PyTorch path), ``triton_path`` (the Triton kernels' glue).
"""

from .dispatch import aha_attention, aha_attention_fast
from .naive import aha_attention_naive

__all__ = ["aha_attention", "aha_attention_fast", "aha_attention_naive"]
