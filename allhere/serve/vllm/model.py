"""vLLM model classes for folders written by ``allhere convert``: vLLM's own implementation of the family
(Llama, Mistral, Qwen2, Qwen3, Gemma-2, Gemma-3, gpt-oss, Granite, Phi-3/4; OLMo-2/3, SmolLM3 and GPT-NeoX through
vLLM's Transformers backend), with the converted layers' attention replaced after vLLM has built the model.
vLLM imports them lazily, by the names ``allhere.serve.vllm.plugin`` registers.

A folder without allhere settings (config.json lacks ``allhere_mechanism``) gets vLLM's own model,
unchanged: the classes below only add to ``__init__``.

Mechanisms served (per converted layer, ``config.allhere_layers``): every kind registered with a ``Serving``
(``allhere.registry``), put on the layers by the installer it names (``allhere.serve.vllm.install``):

- AHA (All-or-Here attention, "Learning When Not to Attend Globally"), sinks, dilated, Longformer, BigBird
  (causal) and DAR: allhere's own attention over the layer's paged cache, one batched call per layer reading per
  (request, query head) only the keys the mechanism's rule allows (``allhere.serve.vllm.layers``,
  ``allhere.serve.vllm.attention``), on vLLM's CPU backend (AHA on CUDA too, through allhere's Triton paged kernel).
  AHA's router ``S = sigmoid(X W_router + b)`` on the attention block's input X (the same weights as allhere
  saved: ``...self_attn.allhere.router.{weight,bias}``) gives the hard gate ``g = S > tau`` per (token, query
  head): the full causal prefix where g, the ``window`` most recent keys elsewhere (and the request's first
  ``sinks`` tokens, ``AHAConfig.sinks``); an AHA layer's cache keeps every key. A sinks layer's
  ``Attention`` is rebuilt to report a KV cache of its own (``allhere.serve.vllm.sink_cache``): the sink blocks and
  the window's, a constant number of blocks per request. DAR keeps the window's K/V in a sliding-window
  cache and every token's d_down latent in a cache of its own, the distant keys rebuilt from the latents at
  every step (``allhere.serve.vllm.dar``).
- sliding: the layer's ``Attention`` rebuilt with ``per_layer_sliding_window = window`` (vLLM then
  keeps a sliding-window KV cache for it).

Window convention: allhere's window w = the w most recent keys, the query's own included
(``q_idx - kv_idx < w``); vLLM's ``sliding_window`` follows Hugging Face's, the same (flash-attn's
``(w - 1, 0)``); so w is handed over as it is to vLLM's sliding layers (``VLLM_WINDOW_OFFSET`` is that one
place); allhere's own attention uses ``allhere.masks.sliding_window`` itself.

KV bytes (``kv_bytes``): what the model's caches keep per token of context, beside the unconverted model's;
written with the routing statistics and printed by ``allhere serve`` once it is ready.

Routing statistics: every AHA layer counts its (token, head) pairs and the global ones over every forward
pass (prefill and decode tokens alike, vLLM's warm-up passes included until ``reset_routing_stats``);
``routing_stats(model)`` (through ``LLM.apply_model``) returns them and mu_f. Where the environment names a
file (``STATS_ENV``, set by ``allhere serve``), the model writes them there after its steps (JSON, replaced
atomically), and zeroes them before a forward while the reset file next to it exists (``allhere serve``
creates it once the server is ready, so vLLM's warm-up passes are not counted). From then on the same numbers go
to vLLM's /metrics where the environment names a Prometheus multiprocess folder (``allhere.serve.vllm.metrics``).

Checked: eager (``enforce_eager=True``), float32, one CPU process: greedy tokens equal allhere's generate
(tests/serve/test_serve_vllm.py). vLLM's default torch.compile gave the same tokens in one run; there
``set_forced_gate`` after start-up is not seen (vLLM drops Dynamo's guards) and the counters are unchecked.
Tensor / pipeline parallelism are refused (the router would need its heads split per rank).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from torch import nn
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.models.gemma2 import Gemma2ForCausalLM
from vllm.model_executor.models.gemma3 import Gemma3ForCausalLM
from vllm.model_executor.models.gpt_oss import GptOssForCausalLM
from vllm.model_executor.models.granite import GraniteForCausalLM
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.mistral import MistralForCausalLM
from vllm.model_executor.models.phi3 import Phi3ForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
from vllm.model_executor.models.transformers import TransformersForCausalLM

from ...hosts import CONFIG_KEY
from .dar import DARServe, LatentCache
from .layers import AHAServe
from .metrics import Metrics, metrics
from .plugin import RESET_SUFFIX, STATS_ENV
from .sink_cache import SinkAttention


def aha_layers(model: nn.Module) -> dict[int, AHAServe]:
    return {m.layer: m for m in model.modules() if isinstance(m, AHAServe)}


def kv_bytes(model: nn.Module, dtype: torch.dtype, max_len: int) -> dict:
    """What the model's KV caches keep, from its vLLM ``Attention`` layers: ``per_token``, bytes per token of
    context (layers that keep every key; DAR's latent rows with their share of the padding of vLLM's pages);
    ``per_request``, bytes of the sliding-window layers' windows and of the sinks layers' sinks and windows (a
    constant per request, past the window; vLLM holds whole blocks of them); ``plain_per_token``, bytes per token
    of the unconverted model (every layer keeping every key, none of allhere's extra caches). AHA's layers count
    per token: they keep every key (their global rows read the whole prefix), so neither their window nor their
    sinks (``AHAConfig.sinks``) frees a block."""
    size = torch.tensor([], dtype=dtype).element_size()
    out = {"per_token": 0, "per_request": 0, "plain_per_token": 0}
    for m in model.modules():
        if isinstance(m, LatentCache):  # DAR's latents (d_down numbers per token), as vLLM's padded pages hold them
            out["per_token"] += m.reserved_numbers() * size
            continue
        if not isinstance(m, Attention) or getattr(m, "kv_sharing_target_layer_name", None):
            continue
        b = 2 * m.num_kv_heads * m.head_size * size
        window = getattr(m, "sliding_window", None)
        if isinstance(m, SinkAttention):
            out["per_request"] += b * min(m.allhere_window + m.allhere_sinks, max_len)
        elif window is not None and window < max_len:
            out["per_request"] += b * window
        else:
            out["per_token"] += b
        out["plain_per_token"] += b
    return {k: round(v) for k, v in out.items()}


def routing_stats(model: nn.Module) -> dict:
    """Global and total (token, head) pairs per AHA layer since the last reset, and mu_f over all of them
    (``LLM.apply_model(routing_stats)``); ``kv``: the caches' bytes (``kv_bytes``)."""
    found = sorted(aha_layers(model).items())
    layers = {i: (int(m.n_global), int(m.n_pairs)) for i, m in found}
    g, n = sum(a for a, _ in layers.values()), sum(b for _, b in layers.values())
    tokens = layers[found[0][0]][1] // found[0][1].router.out_features if found else 0
    return {"layers": layers, "mu_f": g / n if n else None, "tokens": tokens, "kv": getattr(model, "allhere_kv", None)}


def reset_routing_stats(model: nn.Module) -> None:
    for m in aha_layers(model).values():
        m.n_global.zero_()
        m.n_pairs.zero_()


def set_forced_gate(model: nn.Module, value: bool | None) -> int:
    """Force every AHA gate global (True) / local (False), or route again (None); returns the layers set."""
    layers = aha_layers(model)
    for m in layers.values():
        m.forced_gate = value
    return len(layers)


class StatsFile:
    """The routing statistics written to ``path`` for ``allhere serve`` (see the module docstring): after
    every step on the CPU, at most once a second on a GPU (reading the counters synchronises it); and, once the
    counts were zeroed after vLLM's warm-up, the same numbers to ``gauges`` (vLLM's /metrics)."""

    def __init__(self, path: str, cuda: bool, gauges: Metrics | None = None) -> None:
        self.path, self.reset = Path(path), Path(path + RESET_SUFFIX)
        self.every, self.written = (1.0 if cuda else 0.0), 0.0
        self.gauges, self.counting = gauges, False

    def before_forward(self, model: nn.Module) -> None:
        """Zero the counts when asked to: the file says so (no pairs) before the reset file goes, so that
        a reader who sees the reset file gone never reads the counts of before."""
        if self.reset.exists():
            reset_routing_stats(model)
            self.counting = True
            self.write(model)
            self.reset.unlink(missing_ok=True)

    def after_step(self, model: nn.Module) -> None:
        if time.monotonic() - self.written >= self.every:
            self.write(model)

    def write(self, model: nn.Module) -> None:
        stats = routing_stats(model)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(stats))
        os.replace(tmp, self.path)
        if self.gauges is not None and self.counting:
            self.gauges.publish(stats)
        self.written = time.monotonic()


class _Converted:
    """Mixin: build vLLM's model, then install the folder's mechanism (nothing for an unconverted folder)."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        from .install import install  # every served kind's installer and glue, needed once the model is built

        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.allhere_layers = install(self, vllm_config.model_config.hf_config)
        model_config = vllm_config.model_config
        self.allhere_kv = kv_bytes(self, model_config.dtype, model_config.max_model_len)
        path = os.environ.get(STATS_ENV)
        cuda = vllm_config.device_config.device_type == "cuda"
        if path and self.allhere_layers:
            kind = getattr(model_config.hf_config, CONFIG_KEY)["kind"]
            gauges = metrics(kind, self.allhere_kv, bool(aha_layers(self)))
            self.allhere_stats = StatsFile(path, cuda, gauges)
        else:
            self.allhere_stats = None
        if self.allhere_stats is not None:
            self.allhere_stats.write(self)  # the caches' bytes, for allhere serve's first line

    def load_weights(self, weights):
        loaded = super().load_weights(weights)
        for m in self.modules():
            if isinstance(m, DARServe):  # before vLLM's CPU backend repacks the block's weights
                m.absorb()
        return loaded

    def forward(self, *args, **kwargs):
        if self.allhere_stats is not None:
            self.allhere_stats.before_forward(self)
        return super().forward(*args, **kwargs)

    def compute_logits(self, *args, **kwargs):
        logits = super().compute_logits(*args, **kwargs)
        if self.allhere_stats is not None:
            self.allhere_stats.after_step(self)
        return logits


class AllhereLlamaForCausalLM(_Converted, LlamaForCausalLM):
    pass


class AllhereMistralForCausalLM(_Converted, MistralForCausalLM):
    pass


class AllhereQwen2ForCausalLM(_Converted, Qwen2ForCausalLM):
    pass


class AllhereQwen3ForCausalLM(_Converted, Qwen3ForCausalLM):
    pass


class AllhereGemma2ForCausalLM(_Converted, Gemma2ForCausalLM):
    """Gemma-2: its full layers converted (the windowed attention soft-caps its scores as the full one does)."""


class AllhereGemma3ForCausalLM(_Converted, Gemma3ForCausalLM):
    """Gemma-3 (text): allhere converts its full-attention layers; the sliding ones stay vLLM's own."""


class AllhereGptOssForCausalLM(_Converted, GptOssForCausalLM):
    """gpt-oss: its full layers converted (the windowed attention adds the same learned sink logits)."""


class AllhereGraniteForCausalLM(_Converted, GraniteForCausalLM):
    pass


class AllherePhi3ForCausalLM(_Converted, Phi3ForCausalLM):
    """Phi-3 / Phi-4-mini (partial rotary with LongRoPE)."""


class AllhereTransformersForCausalLM(_Converted, TransformersForCausalLM):
    """OLMo-2/3, SmolLM3, GPT-NeoX: families vLLM runs through its Transformers backend (the Hugging Face
    modules, each attention module holding its vLLM ``Attention`` as ``attn``). The served kinds install as on
    vLLM's own classes, but those whose ``Serving`` says ``transformers_backend=False`` (DAR: it rebuilds keys
    through a block taking positions) are refused."""
