"""lm-eval's request conventions, independent of any model: how a (context, continuation) pair becomes
tokens, which requests share one forward pass, in which order and batches they run, how generation
settings and stop strings are read. ``harness.AllhereLM`` follows them so that a plain transformers model
scores every request as lm-eval's own ``hf`` model does.

The conventions (lm-eval 0.4):

- Trailing whitespace of a context belongs to the continuation ("x = " + "[]" is scored as "x =" + " []"),
  and the pair is tokenized as one string: the continuation's tokens are what the whole string has past
  the context's own tokens. An empty context becomes the prefix token (BOS, else EOS), unless the
  continuation itself starts with it.
- The model reads (context + continuation) minus its last token, cut from the left to ``max_length``;
  requests whose input is the same (a multiple-choice question whose one-token answers differ) share one
  forward pass.
- Forward passes run longest first (a batch too large for memory fails at once, not at the end), in
  batches of ``batch_size``; results come back in the order of the requests.
"""

from __future__ import annotations

from typing import Callable, Hashable, Iterable, Sequence

Encode = Callable[[str], list[int]]


def encode_pair(encode: Encode, encode_plain: Encode, prefix_id: int, context: str,
                continuation: str) -> tuple[list[int], list[int]]:
    """(context tokens, continuation tokens). ``encode`` adds the tokenizer's special tokens (a BOS) as
    the model's tokenizer does by default; ``encode_plain`` adds none."""
    if not context:
        cont = encode_plain(continuation)
        if cont and cont[0] == prefix_id:
            return cont[:1], cont[1:]
        return [prefix_id], cont
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    ctx = encode(context)
    return ctx, encode(context + continuation)[len(ctx):]


class Shared:
    """Requests that share one forward pass: the model input and, per request, its index and continuation
    tokens (each is scored on the input's last ``len(continuation)`` positions)."""

    def __init__(self, tokens: list[int], max_length: int) -> None:
        self.tokens = tokens  # context + continuation without its last token, before the cut
        self.input = tokens[-max_length:]
        self.members: list[tuple[int, list[int]]] = []

    @property
    def keep(self) -> int:
        """How many of the last positions any member reads."""
        return min(max(len(c) for _, c in self.members), len(self.input))

    def sort_key(self):
        """Longest first; among equal lengths by the tokens, as lm-eval orders them (the longest
        continuation's whole sequence stands for the group)."""
        _, cont = max(self.members, key=lambda m: len(m[1]))
        return -(len(self.tokens) + 1), (*self.tokens, cont[-1])


def share_inputs(pairs: Sequence[tuple[list[int], list[int]]], max_length: int) -> list[Shared]:
    """One ``Shared`` per distinct model input, sorted longest first. Empty continuations are left out
    (nothing to score: log-probability 0)."""
    groups: dict[tuple[int, ...], Shared] = {}
    for i, (ctx, cont) in enumerate(pairs):
        if not cont:
            continue
        tokens = ctx + cont[:-1]
        group = groups.setdefault(tuple(tokens), Shared(tokens, max_length))
        group.members.append((i, cont))
    return sorted(groups.values(), key=Shared.sort_key)


def chunks(items: Sequence, size: int) -> Iterable[list]:
    for start in range(0, len(items), size):
        yield list(items[start:start + size])


def gen_group_key(kwargs: dict) -> Hashable:
    """Requests with equal generation settings run in the same batches (lm-eval groups them so)."""
    try:
        return tuple((k, tuple(v) if isinstance(v, (list, tuple, set, str)) else v) for k, v in sorted(kwargs.items()))
    except TypeError:
        return repr(kwargs)


MAX_TOKEN_KEYS = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")  # by priority


def generation_settings(gen_kwargs: dict, default_max: int, eos_text: str | None) -> tuple[list[str], int, dict]:
    """(stop strings, new-token limit, the other settings for ``generate``) of a request's generation
    settings: ``until`` (a string or list; the EOS token's text is added), the limit under any of its
    aliases, greedy decoding (``do_sample=False``) unless a positive temperature or ``do_sample`` asks
    for sampling."""
    kwargs = dict(gen_kwargs)
    until = kwargs.pop("until", None)
    until = [until] if isinstance(until, str) else list(until or [])
    if eos_text is not None and eos_text not in until:
        until.append(eos_text)
    limits = [kwargs.pop(k) for k in MAX_TOKEN_KEYS if kwargs.get(k) is not None]
    for k in MAX_TOKEN_KEYS:
        kwargs.pop(k, None)
    limit = int(limits[0]) if limits else default_max
    temperature = float(kwargs.get("temperature", 0.0) or 0.0)
    if kwargs.get("do_sample") is None:
        kwargs["do_sample"] = temperature > 0.0
    if not kwargs["do_sample"]:
        kwargs.pop("temperature", None)  # greedy: a temperature would only make transformers warn
    return until, limit, kwargs


def cut_at_stops(text: str, until: Iterable[str]) -> str:
    """The text before the first occurrence of each stop string in turn (empty ones ignored)."""
    for stop in until:
        if stop:
            text = text.split(stop)[0]
    return text


def max_length_of(config, tokenizer, default: int = 2048) -> int:
    """The context length lm-eval assumes for a transformers model: its config's (``n_positions``,
    ``max_position_embeddings`` or ``n_ctx``; a multimodal config's text part), else the tokenizer's
    ``model_max_length`` unless unset, else ``default``."""
    cfg = getattr(config, "text_config", None) or config
    for name in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(cfg, name, None)
        if value is not None:
            return int(value)
    limit = getattr(tokenizer, "model_max_length", None)
    return int(limit) if limit is not None and limit < 10**29 else default  # transformers' "unset" is ~1e30
