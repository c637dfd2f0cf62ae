"""``HFCausalLM``: a transformers causal LM (converted or plain) with the call interface of
``allhere.Decoder``, so that ``allhere.train.train``, the losses and the context-parallel ring take it."""

from __future__ import annotations

import json

import torch
from torch import nn

from ..mechanisms.base import mechanism_layers
from ..model import DecoderOutput
from ..routing import routed_layers
from .attention import SHARD_POSITIONS
from .convert import LENGTH_DEPENDENT_ROPE, attention_layers, collect_routing, rope_types


class _ConfigView:
    def __init__(self, config) -> None:
        self.config = config

    def to_dict(self) -> dict:
        return {"transformers_config": json.loads(self.config.to_json_string())}


class HFCausalLM(nn.Module):
    """Gives a transformers causal LM (converted or plain) the call interface of ``allhere.Decoder``."""

    rope_restarts_at_segments = True  # packed documents: position ids restart with every document

    def __init__(self, model) -> None:
        super().__init__()
        self.hf = model
        self.cfg = _ConfigView(model.config)

    def forward(self, input_ids: torch.Tensor, segment_starts: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> DecoderOutput:
        """segment_starts [batch, tokens] (``allhere.masks.starts_from``) become what transformers reads:
        position ids that restart with every document, or a padding mask; transformers builds its mask
        from them, and the converted layers read the segments back off it, once per forward.
        (transformers recognises packed documents only without a padding mask, so a batch cannot have
        both.)

        ``positions`` int64 [tokens]: the tokens are a shard of longer sequences at these absolute positions
        (context parallelism, ``allhere.distributed.context``): no mask is built, the mechanisms get the
        positions and the ring masks by them; ``segment_starts`` (in the whole sequence's coordinates) then
        only make the position ids restart with every document."""
        kwargs = {}
        if positions is not None:
            if positions.shape != input_ids.shape[1:] or positions.dtype != torch.int64:
                raise ValueError(f"positions must be int64 [tokens] = [{input_ids.shape[1]}], got {positions.dtype} "
                                 f"{tuple(positions.shape)}")
            ids = positions.expand(input_ids.shape[0], -1)
            kwargs["position_ids"] = ids if segment_starts is None else (ids - segment_starts).clamp_min(0)
        elif segment_starts is not None:
            idx = torch.arange(input_ids.shape[1], device=input_ids.device)
            kwargs["position_ids"] = (idx - segment_starts).clamp_min(0)
            padding = segment_starts < 0
            if bool(padding.any()):
                first = torch.where(padding, input_ids.shape[1], segment_starts).min(1).values
                if bool((padding.any(1) & (segment_starts.max(1).values > first)).any()):
                    raise ValueError("a Hugging Face model takes padding or packed documents in one row, not both")
                kwargs["attention_mask"] = (~padding).long()
        token = SHARD_POSITIONS.set(positions)  # None: a whole sequence
        try:
            out = self.hf(input_ids=input_ids, use_cache=False, **kwargs)
        finally:
            SHARD_POSITIONS.reset(token)
        return DecoderOutput(out.logits, collect_routing(self.hf) if routed_layers(self.hf) else None, None)

    def context_parallel_refusal(self) -> str | None:
        """Why this model cannot run context-parallel (``allhere.distributed.context``), or None. Every
        attention layer must carry a mechanism: a layer left as it was (a hybrid model's sliding-window
        layers, which ``convert`` keeps) runs the host's own attention, which sees only this rank's tokens.
        Rotary frequencies must not depend on the sequence length (dynamic, longrope): transformers would
        choose them from the shard's positions, not the whole sequence's."""
        dynamic = rope_types(self.hf.config) & LENGTH_DEPENDENT_ROPE
        if dynamic:
            return (f"its rope_type {sorted(dynamic)[0]!r} chooses the rotary frequencies from the sequence length, "
                    "which a shard does not see")
        plain = [i for i, m in attention_layers(self.hf) if not mechanism_layers(m)]
        if plain:
            return (f"its attention layers {plain[:8]}{'...' if len(plain) > 8 else ''} have no mechanism: a hybrid "
                    "model's sliding-window layers keep the host's attention, which cannot run context-parallel")
        return None
