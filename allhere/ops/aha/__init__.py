"""All-or-Here attention ("Learning When Not to Attend Globally"; op family ``"aha"``): ``aha_attention`` is
the entry point.

``aha_attention_reference`` is the dense fp32 reference (backend "reference"); ``aha_attention_torch`` the
PyTorch path, ``aha_attention_triton`` the Triton kernels' (``triton_path.triton_refusal`` says which calls
they take); ``aha_attention_fast`` is ``aha_attention`` never on the reference, with the PyTorch path's
tuning knobs. Modules: ``dispatch`` (the entry and the paths' registration), ``reference``, ``fast`` (the
PyTorch path), ``triton_path`` (the Triton kernels' glue).
"""

from ..._deprecated import moved_names
from .dispatch import aha_attention, aha_attention_fast
from .fast import aha_attention_torch
from .reference import aha_attention_reference
from .triton_path import aha_attention_triton

__all__ = ["aha_attention", "aha_attention_fast", "aha_attention_reference", "aha_attention_torch",
           "aha_attention_triton"]

__getattr__ = moved_names(__name__, {"aha_attention_naive": (__name__, "aha_attention_reference")})
