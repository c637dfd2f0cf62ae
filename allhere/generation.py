"""Generate text with a loaded model and hand it on as it comes: a transformers causal LM (plain, or
converted by allhere) through its own ``generate``, or allhere's ``Decoder`` (byte-level tokens) in a loop
over its KV cache.

Streaming: at every new token the whole reply so far is decoded again (tokens merge: the bytes of one
UTF-8 character, SentencePiece's leading spaces), and only text that no later token can change is
handed on; a trailing incomplete character (U+FFFD) and trailing spaces wait for the next token.

mu_f of a reply (models with routed layers, e.g. AHA): the share of (layer, head) gates on full attention
over the decode steps. Each decode step's forward feeds one generated token (with a KV cache that token
alone; without one, the whole sequence, of which the last position is counted), so the count covers every
generated token but the last, which is never fed back; the prompt's forward (prefill) is not counted.
Notation of the AHA paper, "Learning When Not to Attend Globally" (Eq. 8).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from .mechanisms.base import mechanism_layers
from .model import Decoder
from .routing import routed_layers
from .validation import ConfigError

Emit = Callable[[str], None]


class ByteTokenizer:
    """The tokenizer of allhere's own models: the UTF-8 bytes of the text, ids 0..255, no special tokens."""

    eos_token_id = None
    chat_template = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def load(path: str | Path, device: str = "cpu"):
    """(model, tokenizer) in eval mode on ``device``: an allhere checkpoint (``*.safetensors``, a byte-level
    Decoder) or a transformers causal LM folder (plain, or saved converted by allhere)."""
    if Path(path).suffix == ".safetensors" and not Path(path).is_dir():
        from .runtime.model_checkpoint import load_model

        model, _ = load_model(path, device=device)
        if model.cfg.vocab_size != 256:
            raise ConfigError(f"{path} holds a model with {model.cfg.vocab_size} token ids; text generation "
                              "reads allhere checkpoints as byte-level models (256 ids)")
        return model.eval(), ByteTokenizer()
    from .hf.io import load_local

    tokenizer, model = load_local(path)
    return model.to(device).eval(), tokenizer


@dataclass
class Stats:
    prompt_tokens: int  # tokens of the prompt (chat: the whole templated conversation)
    new_tokens: int  # tokens generated (an end-of-sequence token included)
    seconds: float  # wall time of the generation, the prompt's forward (prefill) included
    routed: bool  # whether the model routes (AHA); mu_f is None otherwise
    decode_steps: int = 0  # decode-step forwards counted in mu_f
    full_gates: int = 0  # (layer, head) gates on full attention over those steps
    gates: int = 0  # all (layer, head) gates over those steps
    prompt_mu_f: list[float] | None = None  # per prompt token, its share of (layer, head) gates on full attention

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / max(self.seconds, 1e-9)

    @property
    def mu_f(self) -> float | None:
        """Share of full attention over the decode steps (see the module docstring); None without routing
        or without a decode step."""
        return self.full_gates / self.gates if self.routed and self.gates else None

    def count_prompt(self, routing) -> None:
        """Keep the routing of the prompt's forward (its last ``prompt_tokens`` positions) per token."""
        gates = torch.stack([layer.gates[0, :, -self.prompt_tokens:].float() for layer in routing.per_layer])
        self.prompt_mu_f = gates.mean((0, 1)).tolist()

    def count(self, routing) -> None:
        """Add the routing of one decode step's forward: the gates of its last position."""
        for layer in routing.per_layer:
            g = layer.gates[..., -1]
            self.full_gates += int(g.sum())
            self.gates += g.numel()
        self.decode_steps += 1


@dataclass
class Generated:
    ids: list[int]  # the new token ids
    text: str  # their text (special tokens left out)
    stats: Stats


class TextStream:
    """Token ids in, final text out to ``emit`` as soon as no later token can change it."""

    def __init__(self, tokenizer, emit: Emit | None) -> None:
        self.tokenizer, self.emit = tokenizer, emit
        self.ids: list[int] = []
        self.done = 0  # characters handed on

    def _text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def put(self, ids: list[int]) -> None:
        self.ids.extend(ids)
        text = self._text()
        final = text.rstrip("\ufffd")  # an incomplete UTF-8 character
        if not final.endswith("\n"):
            final = final.rstrip()  # a space may yet go: decoding cleans " ." up to "."
        self._hand_on(text, len(final))

    def end(self) -> str:
        text = self._text()
        self._hand_on(text, len(text))
        return text

    def _hand_on(self, text: str, upto: int) -> None:
        if upto > self.done:
            if self.emit is not None:
                self.emit(text[self.done:upto])
            self.done = upto


def _pick(logits: torch.Tensor, temperature: float, top_p: float | None) -> int:
    """The next token from logits [vocab]: argmax at temperature 0, else a sample of softmax(logits / T),
    with top_p restricted to the most likely tokens whose probabilities first reach top_p."""
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p is None:
        return int(torch.multinomial(probs, 1))
    sorted_p, order = probs.sort(descending=True)
    keep = sorted_p.cumsum(-1) - sorted_p < top_p  # the mass before each token is short of top_p
    return int(order[torch.multinomial(sorted_p * keep, 1)])


def _eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        eos = getattr(source, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else eos or [])
    return ids


@torch.no_grad()
def _decoder_loop(model, prompt: list[int], max_new_tokens: int, temperature: float, top_p: float | None,
                  stream: TextStream, stats: Stats, eos: set[int], use_cache: bool) -> list[int]:
    """allhere's Decoder: one forward per token, over its own KV cache (or the whole sequence without)."""
    device = next(model.parameters()).device
    cache = model.new_cache(len(prompt) + max_new_tokens) if use_cache else None
    out = model(torch.tensor([prompt], device=device), cache=cache)
    if out.routing is not None:
        stats.count_prompt(out.routing)
    new: list[int] = []
    while True:
        token = _pick(out.logits[0, -1], temperature, top_p)
        new.append(token)
        stream.put([token])
        if token in eos or len(new) == max_new_tokens:
            return new
        step = [token] if use_cache else prompt + new
        out = model(torch.tensor([step], device=device), cache=cache)
        if out.routing is not None:
            stats.count(out.routing)


class _Streamer:
    """transformers' streamer interface: ``generate`` puts the prompt first, then each new token."""

    def __init__(self, stream: TextStream) -> None:
        self.stream, self.prompt_seen = stream, False

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:
            self.stream.put(value.reshape(-1).tolist())
        self.prompt_seen = True

    def end(self) -> None:
        pass


@torch.no_grad()
def _hf_generate(model, prompt: list[int], max_new_tokens: int, temperature: float, top_p: float | None,
                 stream: TextStream, stats: Stats, eos: set[int], use_cache: bool, pad: int | None,
                 static_cache: bool = False) -> list[int]:
    """A transformers model: its own ``generate``, a converted one on ``allhere.hf.new_cache`` (in-place
    layers sized for the prompt and the reply, DAR's compressed ones), a plain one on its own; with
    ``static_cache``, either on transformers' ``StaticCache`` (which transformers compiles on a GPU). The model's
    generation config applies but for the length, the end tokens and the sampling settings set here (a
    checkpoint's recommended temperature / top_k / top_p are not used: the caller's are)."""
    config = copy.deepcopy(model.generation_config)
    sample = temperature > 0
    config.update(max_new_tokens=max_new_tokens, num_beams=1, do_sample=sample, eos_token_id=sorted(eos) or None,
                  pad_token_id=pad)
    if sample:  # exactly these (None would bring back the model's own, e.g. its top_k)
        config.update(temperature=temperature, top_p=top_p or 1.0, top_k=0)
    config.use_cache = use_cache and config.use_cache is not False  # a mechanism without a cache says no
    forwards = 0

    def count(module, args, output):  # every forward after the prompt's is a decode step
        nonlocal forwards
        from .hf.convert import collect_routing

        forwards += 1
        (stats.count if forwards > 1 else stats.count_prompt)(collect_routing(model))

    ids = torch.tensor([prompt], device=next(model.parameters()).device)
    cache = {}
    if static_cache:
        config.cache_implementation = "static"
    elif config.use_cache and mechanism_layers(model):  # in-place layers sized once for prompt + reply
        from .hf.cache import cache_kwargs, new_cache

        cache = cache_kwargs(new_cache(model, reserve=len(prompt) + max_new_tokens))
    hook = model.register_forward_hook(count) if stats.routed else None
    try:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                             streamer=_Streamer(stream), **cache)
    finally:
        if hook is not None:
            hook.remove()
    return out[0, len(prompt):].tolist()


def generate(model, tokenizer, prompt: list[int], max_new_tokens: int = 256, temperature: float = 0.0,
             top_p: float | None = None, emit: Emit | None = None, use_cache: bool = True,
             static_cache: bool = False) -> Generated:
    """Continue the token ids ``prompt`` by up to ``max_new_tokens`` tokens, stopping at an end-of-sequence
    token (the model's generation config and the tokenizer's; allhere's byte-level models have none).
    ``emit(text)`` gets the text as it becomes final (see ``TextStream``). temperature 0: greedy; > 0:
    sampling from softmax(logits / temperature), within the top_p nucleus when given (torch's global
    generator: seed it with ``torch.manual_seed``). ``use_cache=False`` runs every step on the whole
    sequence (the same tokens, slower: a check of the cache). ``static_cache``: a transformers model decodes
    over transformers' ``StaticCache`` (see ``check_static_cache``)."""
    if not prompt:
        raise ConfigError("the prompt has no tokens: give some text")
    if static_cache:
        check_static_cache(model)
    if not temperature >= 0 or (top_p is not None and not 0 < top_p <= 1):  # NaN fails both
        raise ConfigError(f"temperature must be >= 0 and top_p in (0, 1], got {temperature} and {top_p}")
    stream = TextStream(tokenizer, emit)
    stats = Stats(prompt_tokens=len(prompt), new_tokens=0, seconds=0.0, routed=bool(routed_layers(model)))
    eos = _eos_ids(model, tokenizer)
    start = time.perf_counter()
    if isinstance(model, Decoder):
        new = _decoder_loop(model, prompt, max_new_tokens, temperature, top_p, stream, stats, eos, use_cache)
    else:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos, default=None)
        new = _hf_generate(model, prompt, max_new_tokens, temperature, top_p, stream, stats, eos, use_cache, pad,
                           static_cache)
    stats.seconds = time.perf_counter() - start
    stats.new_tokens = len(new)
    return Generated(new, stream.end(), stats)


def check_static_cache(model) -> None:
    """Raise ConfigError where ``model`` cannot decode over transformers' ``StaticCache``: an allhere checkpoint
    (not a transformers model), or a converted model whose mechanism reads only its own cache layouts (every
    mechanism but AHA)."""
    if isinstance(model, Decoder):
        raise ConfigError("--static-cache is transformers' StaticCache: it takes a transformers model folder, not an "
                          "allhere checkpoint")
    other = sorted({type(m).__name__ for m in mechanism_layers(model) if not m.takes_kv_len})
    if other:
        raise ConfigError(f"--static-cache: {', '.join(other)} does not decode over transformers' StaticCache (AHA "
                          "and plain models do); leave it out")


def template_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the conversation rendered by the tokenizer's chat template, ending with the prompt of
    the assistant's reply."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def chat(model, tokenizer, turns: Iterable[str], emit: Emit | None = None, messages: list[dict] | None = None,
         **settings) -> Iterator[Generated]:
    """A conversation: each turn (blank ones skipped) is added as the user's message, the conversation is
    rendered with the tokenizer's chat template, the reply generated (``generate``'s settings), handed to
    ``emit`` and added as the assistant's message. ``messages``: the conversation so far (extended in
    place). Yields each reply."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("the tokenizer has no chat template (allhere.data.chat.ensure_chat_template installs "
                          "the fallback one)")
    messages = [] if messages is None else messages
    for turn in turns:
        text = turn.strip()
        if not text:
            continue
        messages.append({"role": "user", "content": text})
        reply = generate(model, tokenizer, template_ids(tokenizer, messages), emit=emit, **settings)
        messages.append({"role": "assistant", "content": reply.text})
        yield reply
