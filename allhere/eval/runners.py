"""The model side of the lm-eval integration: batched log-probabilities and cached greedy generation,
for a transformers model (plain, or converted by allhere) and for allhere's own byte-level ``Decoder``.

Padding. Log-probabilities run on right-padded batches: on a plain transformers model without a mask,
as lm-eval's ``hf`` model runs them (a causal model never lets a real token see the padding after it);
on a converted model with transformers' attention mask, which allhere's mask function turns into
explicit segment starts (-1 = padding, which the mechanisms then skip); on a ``Decoder`` through
``segment_starts`` (``allhere.masks.starts_from``). A mechanism that refuses segment starts (one whose
budget spans the whole sequence) gets batches of equal-length rows instead, unpadded. Only the
positions some request reads get logits (transformers' ``logits_to_keep``).

Generation on transformers models is ``model.generate`` on a left-padded batch with the model's own KV
cache, as lm-eval does it. A ``Decoder`` generates one request at a time with its own cache
(``Decoder.new_cache``): left padding would move a row's tokens away from position 0, where a
mechanism anchored at absolute positions (attention sinks, global tokens) keeps its anchors.

mu_f (the AHA paper's Eq. 8) is counted per task over the real tokens the model reads: padding is left
out, and in batched generation so are the tokens a row is fed after it has met a stop string (the batch
runs on until it stops as a whole).
"""

from __future__ import annotations

import inspect
from collections import defaultdict

import torch
import torch.nn.functional as F

from ..masks import starts_from
from ..routing import routed_layers


class Runner:
    """What both kinds of model share: padded batches of log-probabilities, and the mu_f tally."""

    eos_text: str | None = None

    def __init__(self, model, device: torch.device) -> None:
        self.model, self.device = model, device
        self.routed = bool(routed_layers(model))
        self.gates = defaultdict(lambda: [0.0, 0])  # task -> [sum of mu_f x tokens, tokens]
        self.pads: bool | None = None  # whether the model takes padded batches (None: not tried yet)

    def mu_f(self) -> dict[str, float]:
        return {task: s / n for task, (s, n) in self.gates.items() if n}

    def record(self, routing, real: torch.Tensor | None, tasks) -> None:
        """Add each row's mu_f over its real tokens (``real`` bool [b, n]; None: all) to its task."""
        if routing is None:
            return
        b, n = routing.per_layer[0].gates.shape[0], routing.per_layer[0].gates.shape[2]
        real = torch.ones(b, n, dtype=torch.bool) if real is None else real.bool()
        for i, task in enumerate(tasks):
            count = int(real[i].sum())
            if task is None or count == 0:
                continue
            only = torch.zeros_like(real)
            only[i] = real[i]
            g = self.gates[task]
            g[0] += routing.mu_f(padding_mask=only).item() * count
            g[1] += count

    @torch.no_grad()
    def logprobs(self, inputs: list[list[int]], keep: list[int], tasks) -> list[torch.Tensor]:
        """Per input, the log-probabilities [keep, vocab] of the next token at its last ``keep`` positions,
        in the model's dtype (as lm-eval computes them). Inputs of different lengths are right-padded."""
        if len({len(x) for x in inputs}) == 1:
            return self._batch(inputs, keep, tasks, padded=False)
        if self.pads is not False:
            try:
                out = self._batch(inputs, keep, tasks, padded=True)
                self.pads = True
                return out
            except (ValueError, NotImplementedError):
                if self.pads:  # it took padding before: a real error
                    raise
                self.pads = False  # refused segment boundaries: equal lengths only from now on
        out: list[torch.Tensor | None] = [None] * len(inputs)
        by_length = defaultdict(list)
        for i, x in enumerate(inputs):
            by_length[len(x)].append(i)
        for rows in by_length.values():
            for i, lp in zip(rows, self._batch([inputs[i] for i in rows], [keep[i] for i in rows],
                                               [tasks[i] for i in rows], padded=False)):
                out[i] = lp
        return out

    def _batch(self, inputs, keep, tasks, padded: bool) -> list[torch.Tensor]:
        lengths = [len(x) for x in inputs]
        width = max(lengths)
        ids = torch.zeros(len(inputs), width, dtype=torch.long)
        real = torch.zeros(len(inputs), width, dtype=torch.bool)
        for i, x in enumerate(inputs):
            ids[i, :len(x)] = torch.tensor(x)
            real[i, :len(x)] = True
        first = min(n - k for n, k in zip(lengths, keep))  # the first position any row reads
        logits, routing = self.forward(ids.to(self.device), real.to(self.device) if padded else None, first)
        self.record(routing, real, tasks)
        return [F.log_softmax(logits[i, n - k - first:n - first], dim=-1)
                for i, (n, k) in enumerate(zip(lengths, keep))]

    def forward(self, ids, real, first):
        """(logits of positions first.. [b, n - first, vocab], Routing or None) of right-padded ids;
        ``real`` bool [b, n] marks the tokens (None: no padding)."""
        raise NotImplementedError


class HFRunner(Runner):
    """A transformers causal LM and its tokenizer, with lm-eval's ``hf`` tokenization rules."""

    def __init__(self, model, tokenizer, device, add_bos_token: bool | None = None) -> None:
        super().__init__(model, device)
        from ..mechanisms.base import mechanism_layers

        self.tok = tokenizer
        self.converted = bool(mechanism_layers(model))
        self.add_bos_token = add_bos_token
        self.keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        t = tokenizer
        self.prefix_id = t.bos_token_id if t.bos_token_id is not None else t.eos_token_id
        self.prefix_text = None if self.prefix_id is None else t.decode([self.prefix_id])
        self.eos_text = None if t.eos_token_id is None else t.decode([t.eos_token_id], skip_special_tokens=False)
        self.pad_id = next((i for i in (t.pad_token_id, t.unk_token_id, t.eos_token_id) if i is not None), 0)

    def encode(self, text: str, special: bool | None = None) -> list[int]:
        """Tokens of ``text``; ``special`` None: the tokenizer's special tokens (its BOS), unless
        ``add_bos_token`` says otherwise or the text already starts with the prefix token."""
        if special is None:
            special = self.add_bos_token
            if self.prefix_text and text.startswith(self.prefix_text):
                special = False
        return self.tok.encode(text, **({} if special is None else {"add_special_tokens": special}))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """A generation batch's prompts: special tokens decided by the first prompt, as lm-eval does."""
        special = self.add_bos_token
        if self.tok.bos_token and texts[0].startswith(self.tok.bos_token):
            special = False
        return [self.tok.encode(t, **({} if special is None else {"add_special_tokens": special})) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def forward(self, ids, real, first):
        kwargs = {"use_cache": False}  # nothing follows: no KV cache to build
        if real is not None and self.converted:  # the mechanisms get the padding as segment starts
            kwargs["attention_mask"] = real.long()
        if self.keeps_logits:
            kwargs["logits_to_keep"] = ids.shape[1] - first
        logits = self.model(input_ids=ids, **kwargs).logits
        return logits[:, -(ids.shape[1] - first):], self._routing()

    def _routing(self):
        if not self.routed:
            return None
        from ..hf import collect_routing

        return collect_routing(self.model)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], limit: int, until: list[str], settings: dict,
                 tasks) -> list[list[int]]:
        """New tokens per prompt: ``model.generate`` on the left-padded batch, stopping as lm-eval does."""
        from transformers import StoppingCriteriaList

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        stop = StopStrings(self.tok, until, width, len(prompts))
        hook = None
        if self.routed:
            def tally(module, args, kwargs, output):
                fed, seen = kwargs.get("input_ids"), kwargs.get("attention_mask")  # no mask: no padding
                if fed is None:
                    return
                n = fed.shape[1]
                real = torch.ones(fed.shape, dtype=torch.bool) if seen is None else seen[:, -n:].bool().cpu()
                real &= ~torch.tensor(stop.done)[:, None]
                self.record(self._routing(), real, tasks)

            hook = self.model.register_forward_hook(tally, with_kwargs=True)
        try:
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      max_length=width + limit, stopping_criteria=StoppingCriteriaList([stop]),
                                      pad_token_id=self.pad_id, use_cache=True, **settings)
        finally:
            if hook is not None:
                hook.remove()
        return out[:, width:].tolist()


class StopStrings:
    """lm-eval's stopping rule for a batch: a row has met a stop string once the text of its last new
    tokens (as many as the string's own tokens, and 2 more) contains it; the batch stops when one stop
    string has been met by every row. Rows that end at the EOS token stop by themselves."""

    def __init__(self, tokenizer, until: list[str], prompt_width: int, rows: int) -> None:
        self.tok, self.width = tokenizer, prompt_width
        self.until = [(s, len(tokenizer.encode(s, add_special_tokens=False)) + 2) for s in until]
        self.met = [[False] * rows for _ in until]  # per stop string, per row
        self.rows = rows

    @property
    def done(self) -> list[bool]:
        """Per row: whether it has met any stop string."""
        return [any(m[i] for m in self.met) for i in range(self.rows)]

    def __call__(self, input_ids, scores, **kwargs) -> bool:
        new = input_ids[:, self.width:]
        for (text, look), met in zip(self.until, self.met):
            for i, row in enumerate(new[:, -look:].tolist()):
                # one row at a time: batch_decode would run on the tokenizer's thread pool, which competes
                # with torch's threads for the cores at every step (much slower on a loaded 2-core machine)
                met[i] = met[i] or text in self.tok.decode(row)
        return any(all(met) for met in self.met)


class _Bytes:
    """The byte tokenizer of allhere's own models: UTF-8 bytes, no special tokens."""

    prefix_id = 10  # "\n": a document of the training corpus starts after one (``allhere.data.corpus``)
    eos_text = None

    def encode(self, text: str, special: bool | None = None) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class DecoderRunner(_Bytes, Runner):
    """An allhere ``Decoder`` checkpoint (byte-level)."""

    def forward(self, ids, real, first):
        starts = None if real is None else starts_from(padding_mask=real)
        out = self.model(ids, segment_starts=starts)
        return out.logits[:, first:], out.routing

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], limit: int, until: list[str], settings: dict,
                 tasks) -> list[list[int]]:
        """Greedy decoding with the model's own KV cache, one prompt at a time; a row stops at the first
        stop string in its text."""
        if settings.get("do_sample"):
            raise NotImplementedError("allhere checkpoints decode greedily; this task asks for sampling (do_sample)")
        results = []
        for prompt, task in zip(prompts, tasks):
            cache = self.model.new_cache(max(1, len(prompt)) + limit)
            step = torch.tensor([prompt or [self.prefix_id]], device=self.device)
            new: list[int] = []
            while len(new) < limit:
                out = self.model(step, cache=cache)
                self.record(out.routing, None, [task])
                new.append(int(out.logits[0, -1].argmax()))
                text = self.decode(new)
                if any(s and s in text for s in until):
                    break
                step = torch.tensor([[new[-1]]], device=self.device)
            results.append(new)
        return results
