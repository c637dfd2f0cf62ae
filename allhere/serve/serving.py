"""Which mechanisms allhere's vLLM plugin serves, and how: each kind's ``allhere.registry.Serving``, declared once
where the mechanism registers (``register(..., serving=Serving(...))``). A kind registered without it is not
served. Plain Python, no vLLM import: read by ``allhere serve``'s checks before vLLM starts
(``allhere.serve.launch``) and by the layer installer inside it (``allhere.serve.vllm.install``), so both refuse
the same things in the same words.
"""

from __future__ import annotations

from .. import registry
from ..registry import Serving

BACKENDS = {"cpu": "CPU", "cuda": "CUDA"}  # vLLM device type -> how the messages name its backend
# the path of the layers allhere computes (op family "paged" of allhere.backend: allhere.ops.paged.dispatch), chosen
# by ``allhere serve --backend`` and handed to the engine in this variable
BACKEND_ENV = "ALLHERE_SERVE_BACKEND"
SERVE_BACKENDS = ("auto", "torch", "triton", "reference")


def spec(kind) -> Serving | None:
    """How ``kind`` is served; None where it is not (registered without ``serving``, or not a registered kind)."""
    if not isinstance(kind, str) or kind not in registry.kinds():
        return None
    return registry.get(kind).serving


def kinds(device: str | None = None, transformers_backend: bool = False) -> tuple[str, ...]:
    """The served kinds, in the registry's order: all of them, or those that run on vLLM device type ``device``
    (and, with ``transformers_backend``, on the families vLLM runs through its Transformers backend)."""
    return tuple(k for k in registry.kinds() if (s := spec(k)) is not None
                 and (device is None or device in s.devices) and (s.transformers_backend or not transformers_backend))


def _backends(devices) -> str:
    names = [BACKENDS.get(d, d) for d in devices]
    return f"{' and '.join(names)} backend{'s' if len(names) > 1 else ''}"


def refusal(kind, device: str, arch: str | None = None, transformers_backend: bool = False) -> str | None:
    """None where a converted folder of mechanism ``kind`` is served on vLLM device type ``device`` for
    architecture ``arch`` (``transformers_backend``: a family vLLM runs through its Transformers backend), else why
    not (one line)."""
    s = spec(kind)
    if s is None:
        return f"mechanism {kind!r} is not served by allhere's vLLM plugin (served: {', '.join(kinds())})"
    if device not in s.devices:
        return (f"{kind} is served on vLLM's {_backends(s.devices)} only so far (served on "
                f"{BACKENDS.get(device, device)}: {', '.join(kinds(device)) or 'nothing'})")
    if transformers_backend and not s.transformers_backend:
        return (f"{kind} is not served on {arch}, which vLLM runs through its Transformers backend (served there: "
                f"{', '.join(kinds(device, transformers_backend=True))})")
    return None
