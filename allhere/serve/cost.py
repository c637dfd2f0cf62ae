"""What a served mechanism's attention does for one decode token against the unconverted model's, per layer: its
multiply-adds (MACs) and the KV-cache bytes it reads, at a context length, from a converted folder's config alone
(no vLLM). ``allhere serve`` prints it when it starts, with what it implies; docs/serving.md checks it against the
measured speeds.

Per query head of size d, at context T, window w (plain attention: 2 d MACs per key, 2 d numbers per key and KV
head read):

- sliding, sinks, Longformer, dilated, BigBird: the keys their mask lets the newest token read (counted from the
  mask itself, per head; bytes: the union over the heads of a KV group);
- AHA: the window for every head, all T keys for the share ``mu_f`` of (token, head) pairs that go global; known
  only while serving (the routing line), so the figure is given per unit of mu_f; a KV head is read in full when
  any head of its group is global, so its bytes lie between mu_f and group x mu_f of the far keys';
- DAR: the window, then per distant key its key rebuilt from the d_c-number latent (kv_heads x d x d_c MACs),
  scored (d) and its latent weighted (d_c): bytes d_c numbers per key;
- dar_latent: the window, then per distant key a row [c ; k^R of every KV head] (d_c + kv_heads x r numbers)
  scored absorbed (that width) and its latent weighted (d_c), nothing rebuilt.

Time is about max(MACs / compute rate, bytes / memory rate) plus a fixed cost per layer and step (allhere's
operators around vLLM's kernels: tenths of a millisecond on a CPU core). A step that reads little (one request,
a cache that fits the CPU's caches) runs at the compute rate; many long requests at the memory rate. So a
mechanism with fewer MACs and bytes pays where its savings outweigh the fixed cost; one with more MACs but fewer
bytes pays only where memory bounds the step.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import registry


@dataclass(frozen=True)
class Work:
    """Per decode token and layer, against the unconverted model at the same context: ``macs`` and ``bytes``
    ratios; for AHA (``per_mu_f``) the ratios are ``macs`` + mu_f x ``per_mu_f`` (bytes at least that)."""

    kind: str
    context: int
    macs: float
    bytes: float
    per_mu_f: float | None = None

    def verdict(self) -> str:
        if self.per_mu_f is not None:
            return ("it pays where the global share keeps both well under 1x, enough to outweigh its fixed cost "
                    "per layer: long contexts, not short prompts")
        if self.macs >= 1 and self.bytes >= 1:
            return "no faster than the unconverted model at any batch"
        if self.macs >= 1:
            return (f"faster only where reading the unconverted model's KV cache takes over {self.macs:.1f}x as long "
                    f"as its multiply-adds (decode bound by memory: many requests, long contexts); where that cache "
                    f"fits the processor's caches (one request) it is slower")
        return "faster where these savings outweigh its fixed cost per layer: long contexts, not short prompts"

    def line(self) -> str:
        if self.per_mu_f is not None:
            # no "mu_f" in this line: readers of the server's output take the lines with it for routing lines
            work = (f"{self.macs:.3f}x + {self.per_mu_f:.3f}x per unit of global share (the routing line's share "
                    f"of (token, head) pairs on full attention) of the unconverted model's attention multiply-adds, "
                    f"and at least as much of its KV bytes")
        else:
            work = (f"{self.macs:.2f}x the unconverted model's attention multiply-adds and {self.bytes:.2f}x its "
                    f"KV bytes read")
        return (f"cost model ({self.kind}, one decode token at {self.context} tokens of context, per layer): "
                f"{work}: {self.verdict()}")


def shape(config: dict) -> tuple[int, int, int] | None:
    """(query heads, KV heads, head size) of a saved model's config.json (its ``text_config`` where it nests one);
    None where it does not say them plainly."""
    text = config.get("text_config") if "num_attention_heads" not in config else config
    if not isinstance(text, dict):
        return None
    heads, hidden = text.get("num_attention_heads"), text.get("hidden_size")
    kv_heads = text.get("num_key_value_heads") or heads
    d = text.get("head_dim") or (hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads
                                 else None)
    if not all(isinstance(x, int) and x > 0 for x in (heads, kv_heads, d)) or heads % kv_heads:
        return None
    return heads, kv_heads, d


def decode_work(config: dict, context: int) -> Work | None:
    """The ``Work`` of the converted model of ``config`` (a config.json with ``allhere_mechanism``) at
    ``context`` tokens; None where it has no mechanism or one this model does not cover."""
    mech = config.get("allhere_mechanism")
    if not isinstance(mech, dict) or context < 1:
        return None
    dims = shape(config)
    if dims is None:
        return None
    cfg = registry.from_dict(mech)
    heads, g, d = dims
    t = context
    plain_macs, plain_bytes = heads * 2 * d * t, g * 2 * d * t

    def ratios(macs: float, numbers: float, per_mu_f: float | None = None) -> Work:
        return Work(cfg.kind, t, macs / plain_macs, numbers / plain_bytes, per_mu_f)

    window = getattr(cfg, "window", None)
    near = min(window or 0, t)
    if cfg.kind == "aha":
        far = t - near
        return ratios(heads * 2 * d * near, g * 2 * d * near, far / t)
    if cfg.kind == "dar":
        far = t - near
        return ratios(heads * 2 * d * near + far * (g * d * cfg.d_down + heads * (d + cfg.d_down)),
                      g * 2 * d * near + far * cfg.d_down)
    if cfg.kind == "dar_latent":
        far, width = t - near, cfg.d_down + g * 2 * cfg.rope_pairs
        return ratios(heads * 2 * d * near + far * heads * (width + cfg.d_down), g * 2 * d * near + far * width)
    if cfg.kind == "sliding":
        return ratios(heads * 2 * d * near, g * 2 * d * near)
    if hasattr(cfg, "mask_fn"):
        import torch

        h, kv = torch.arange(heads)[:, None], torch.arange(t)[None]
        seen = cfg.mask_fn(t)(torch.zeros(1, dtype=torch.long), h, torch.full((1, 1), t - 1), kv)
        seen = seen.expand(heads, t)
        per_kv = seen.view(g, heads // g, t).any(1)
        return ratios(int(seen.sum()) * 2 * d, int(per_kv.sum()) * 2 * d)
    return None
