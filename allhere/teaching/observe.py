"""Watch the routed layers of a model through one forward pass: each AHA layer's attention inputs handed to a
callback, through torch's own forward hooks (nothing of the model is patched)."""

from __future__ import annotations

import contextlib
from typing import Callable

from ..routing import routed_layers


@contextlib.contextmanager
def observe_routed(model, fn: Callable) -> None:
    """While inside, every forward of a routed layer calls ``fn(row, mech, q, k, v, call)``: ``row`` the layer's
    place among the routed layers (``allhere.routing.routed_layers``), q [b, heads, q_len, d] and k, v [b,
    kv_heads, kv_len, d] as the mechanism gets them (after the host's rotary embedding and cache), ``call`` its
    ``AttentionCall`` (``call.x``: the router's input)."""
    handles = []
    for row, (_, mech) in enumerate(routed_layers(model)):
        def hook(m, args, kwargs, output, row=row):
            fn(row, m, *args[:4])  # mechanisms are called as mech(q, k, v, call, cache=...)

        handles.append(mech.register_forward_hook(hook, with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
