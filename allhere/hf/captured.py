"""Greedy decoding with one decode step captured as a CUDA graph and replayed for every new token.

A decode step of a 1B-parameter model at batch 8 runs ~780 small kernels, ~48 per layer, each launched by
Python: on an H200 the host takes 14-19 ms per step where the GPU works 3.5-4.2 ms, for a plain model and
a converted one alike. Captured once, a step replays those launches without Python, and what the
attention skips (AHA's local heads read w keys, not the cache) becomes the step's time.

What makes a step capturable: transformers' own ``StaticCache`` (whole buffers written in place at a device
count, ``cumulative_length``), the positions as a device tensor advanced in place, no attention mask (one
sequence per row, no padding), and attention that reads the lengths on the device: transformers' SDPA over
the static buffers with its mask, or for a converted layer allhere's decode kernel with ``kv_len``
(``allhere.hf.attention.static_call``). The prompt is run eagerly first (one forward, its keys written into
the static buffers). Off CUDA, or with ``capture=False``, the same step runs eagerly: what the tests check.
Not capturable, and refused or failing with the reason: models with sliding-window layers (transformers'
sliding static layers count on the host), AHA off the Triton kernels (fp32, head dims they do not take:
the lengths are read on the host) and AHA with a forced gate (``set_forced_gate``).
"""

from __future__ import annotations

import inspect

import torch

from .cache import cache_kwargs


class CapturedDecode:
    """Greedy decoding of ``batch`` rows for up to ``max_len`` tokens (prompt and new ones) with ``model``'s
    decode step captured once (``capture``: default on CUDA)."""

    def __init__(self, model, batch: int, max_len: int, capture: bool | None = None) -> None:
        from transformers.cache_utils import StaticCache

        self.model, self.batch, self.max_len = model, batch, max_len
        self.device = next(model.parameters()).device
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError("a CUDA graph needs the model on a CUDA device")
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        if self.capture and any(getattr(layer, "is_sliding", False) for layer in self.cache.layers):
            raise ValueError("a model with sliding-window layers (their static layers keep a count on the host, "
                             "which a captured graph would freeze) cannot be captured; capture=False runs it "
                             "eagerly")
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        self.pos = torch.zeros(1, dtype=torch.long, device=self.device)  # the new token's position
        # transformers versions that still take cache_position would derive it from the cache's count on
        # the host (a sync, which a capture refuses): handed over where the model takes it
        takes = inspect.signature(model.forward).parameters
        self._position_kw = "cache_position" if "cache_position" in takes else None
        self.graph = None
        self._logits = None
        self.length = 0

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        extra = {} if self._position_kw is None else {self._position_kw: positions}
        out = self.model(ids, position_ids=positions[None].expand(ids.shape[0], -1), use_cache=True,
                         logits_to_keep=1, **cache_kwargs(self.cache), **extra)
        return out.logits[:, -1]

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Run the prompt ``ids`` [batch, n] (every token real) eagerly; the logits of its last token."""
        if ids.shape[0] != self.batch or ids.shape[1] >= self.max_len or self.length:
            raise ValueError(f"prefill takes one prompt of [{self.batch}, < {self.max_len}] tokens into an empty "
                             f"cache, got {tuple(ids.shape)} with {self.length} tokens held")
        logits = self._forward(ids.to(self.device), torch.arange(ids.shape[1], device=self.device))
        self.pos.fill_(ids.shape[1])
        self.length = ids.shape[1]
        return logits

    def resume(self) -> None:
        """Decode on after the tokens already written into ``self.cache`` through its layers' ``update`` (a
        benchmark fills it so, without running a prompt)."""
        counts = {int(layer.cumulative_length) for layer in self.cache.layers if layer.is_initialized}
        if len(counts) != 1 or not 0 < min(counts) < self.max_len:
            raise ValueError(f"resume needs every layer of the cache holding one count under {self.max_len}, "
                             f"got {sorted(counts)}")
        self.length = counts.pop()
        self.pos.fill_(self.length)

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append ``tokens`` [batch] (one per row); the logits [batch, vocab] of the next token (a buffer the
        next step overwrites)."""
        if not self.length:
            raise RuntimeError("prefill a prompt first")
        if self.length >= self.max_len:
            raise ValueError(f"the static cache holds {self.max_len} tokens; all are used")
        self.ids.copy_(tokens.reshape(self.batch, 1))
        if not self.capture:
            logits = self._forward(self.ids, self.pos)
        else:
            if self.graph is None:
                self._capture()
            self.graph.replay()
            logits = self._logits
        self.pos.add_(1)
        self.length += 1
        return logits

    def _capture(self) -> None:
        """One eager run of the step (kernels tuned and compiled, buffers allocated) on a side stream, the
        caches' counts set back, then the capture; the first replay does this step's work."""
        counts = [layer.cumulative_length.clone() for layer in self.cache.layers]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(self.ids, self.pos)
        torch.cuda.current_stream().wait_stream(stream)
        for layer, count in zip(self.cache.layers, counts):
            layer.cumulative_length.copy_(count)
        self.graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(self.graph):
                self._logits = self._forward(self.ids, self.pos)
        except RuntimeError as e:
            self.graph = None
            raise RuntimeError(f"the decode step could not be captured as a CUDA graph ({str(e).splitlines()[0]}): "
                               "something in it reads a tensor back to the host (an attention path without "
                               "device lengths, e.g. AHA in fp32 off the Triton kernels?); capture=False runs it "
                               "eagerly") from e

    def generate(self, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """Greedy continuation: [batch, new_tokens] after the prompt ``ids`` [batch, n]."""
        token = self.prefill(ids).argmax(-1)
        out = [token]
        for _ in range(new_tokens - 1):
            token = self.step(token).argmax(-1)
            out.append(token)
        return torch.stack(out, 1)
