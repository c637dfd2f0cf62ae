"""Calibration text that needs distant tokens: windows of a text with facts planted early and asked for late.

A router is taught where the full model reads far back (``allhere.teaching.teach``); ordinary text rarely makes
it, so a teacher on it alone never shows a router a retrieval. Each calibration window here is a run of the
user's text with ``facts`` facts stated in its first part and each asked for again after more than ``distance``
tokens (beyond the window), answered in the text itself, so that the model's own attention at the answer shows
what must be read globally. The forms are natural sentences and code (a key and its value, a code to remember,
a date, a constant and the check that repeats it); none is the passkey evaluation's wording
(``allhere.eval.passkey``), which the teaching must not see.
"""

from __future__ import annotations

import random

import torch

from ..validation import ConfigError

NAMES = ("amber", "cobalt", "scarlet", "olive", "ivory", "violet", "copper", "silver", "indigo", "crimson",
         "teal", "ochre")
PEOPLE = ("Ada", "Boris", "Chen", "Dalia", "Emil", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kasia", "Lior")
CONSTANTS = ("RETRY_LIMIT", "MAX_DEPTH", "DEFAULT_PORT", "BUFFER_SIZE", "CACHE_TTL", "PAGE_OFFSET", "TIMEOUT_MS",
             "BLOCK_COUNT")
HAYSTACK_RUN = (24, 64)  # tokens of text repeated in a haystack window (shortest, longest)
FILLERS = ("text", "prose")  # what a haystack repeats: a run of the user's text, or plain sentences made here
THINGS = ("river", "lamp", "road", "stone", "door", "field", "cloud", "bread", "chair", "bell", "wall", "boat",
          "hill", "rope", "coat", "wind")
QUALITIES = ("wide", "bright", "quiet", "cold", "old", "warm", "tall", "soft", "loud", "dark", "round", "heavy")
FORMS = (  # (statement, question whose last words lead to the answer {n}); {x} a name, {p} a person
    ("The code for the {x} locker is {n}.", "Which code opens the {x} locker? The code for the {x} locker is {n}."),
    ("Note: {p}'s access number is {n}.", "What was {p}'s access number? {p}'s access number is {n}."),
    ("The {x} shipment left on day {n}.", "On which day did the {x} shipment leave? It left on day {n}."),
    ("Remember this number: {n}.", "Which number were you asked to remember? The number was {n}."),
    ("{c} = {n}\n", "assert {c} == {n}\n"),
    ("# {p} filed ticket {n} about the {x} module.\n", "# the {x} module's ticket, filed by {p}: {n}\n"),
)
SENTENCES = 4  # the first FORMS are sentences: the only ones planted in prose haystacks (the others are code's)


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _prose(tokenizer, draw: random.Random, tokens: int) -> list[int]:
    """At least ``tokens`` tokens of a short run of plain sentences ("The road is cold. The bell is loud. ...",
    3 to 6 of them, drawn by ``draw``) said over and over: uniform filler in natural language."""
    run = " ".join(f"The {draw.choice(THINGS)} is {draw.choice(QUALITIES)}." for _ in range(draw.randint(3, 6)))
    ids = _encode(tokenizer, " " + run)
    return ids * (tokens // max(1, len(ids)) + 1)


def retrieval_windows(tokenizer, documents: list[torch.Tensor], count: int, length: int, distance: int,
                      facts: int = 2, seed: int = 0, with_answers: bool = False, haystacks: int = 0,
                      filler: str = "text"):
    """``count`` windows of ``length`` tokens [count + haystacks, length]: runs of ``documents`` (token ids, each
    a tensor; a run stays within one document where one is long enough, else runs on into the next) with ``facts``
    facts planted per window, each statement more than ``distance`` tokens before its question, questions at the end
    of the window. A pure function of ``seed``. ``with_answers``: also the bool of the same shape marking the
    positions that ask for a planted fact and predict its answer (each question's tokens up to its answer's last
    one: where the model must read the fact beyond the window). ``haystacks``: that many more windows after them,
    each a short run of the text (``HAYSTACK_RUN`` tokens) repeated to fill it, facts planted as in the others:
    where every stretch looks alike and only the planted fact is new (the passkey tests' kind of text, made of the
    user's own; the first ``count`` windows are the same with or without them). ``filler``: what a haystack
    repeats, one of ``FILLERS``: "text" the user's text as above, "prose" a few plain sentences made here from
    word lists ("The road is cold. The bell is loud.", none of the passkey evaluation's sentences), its facts
    and questions sentences too (``FORMS[:SENTENCES]``)."""
    if filler not in FILLERS:
        raise ConfigError(f"calibration haystack filler must be one of {FILLERS}, got {filler!r}")
    rng, hay_rng = random.Random(seed), random.Random(seed + 1)
    marks = []
    stream = torch.cat(documents) if documents else torch.zeros(0, dtype=torch.long)
    out = []
    for i in range(count + haystacks):
        draw = rng if i < count else hay_rng
        pairs, answers = [], []
        for _ in range(facts):
            form = FORMS[draw.randrange(SENTENCES if i >= count and filler == "prose" else len(FORMS))]
            value = dict(x=draw.choice(NAMES), p=draw.choice(PEOPLE), c=draw.choice(CONSTANTS),
                         n=str(draw.randint(10000, 99999)))
            before, after = form[1].split("{n}")  # the question tokenized in three parts: the answer's are known
            parts = [_encode(tokenizer, " " + before.format(**value)), _encode(tokenizer, value["n"]),
                     _encode(tokenizer, after.format(**value) + " ")]
            pairs.append([_encode(tokenizer, " " + form[0].format(**value) + " "), sum(parts, [])])
            answers.append((len(parts[0]), len(parts[1])))
        planted = sum(len(a) + len(b) for a, b in pairs)
        text = length - planted
        if text < distance + 1 or len(stream) < text:
            raise ConfigError(f"the text has {len(stream)} tokens: {length}-token calibration windows cannot hold "
                              f"{facts} facts {distance} tokens apart in it (at least {distance + 1 + planted} tokens "
                              "of text are needed)")
        start = draw.randrange(len(stream) - text + 1)
        piece = stream[start:start + text].tolist()
        if i >= count and filler == "prose":  # a haystack: the same few sentences over and over
            piece = _prose(tokenizer, draw, text)[:text]
        elif i >= count:  # a haystack: the window's first lines over and over
            run = draw.randint(*HAYSTACK_RUN)
            piece = (piece[:run] * (text // run + 1))[:text]
        early = text - distance  # statements go into the first text - distance tokens
        at = sorted(draw.randrange(early) for _ in pairs)
        ids, last = [], 0
        for (statement, _), cut in zip(pairs, at):
            ids += piece[last:cut] + statement
            last = cut
        ids += piece[last:]
        found = torch.zeros(length, dtype=torch.bool)
        for (_, question), (asked, digits) in zip(pairs, answers):
            # the question's tokens up to its answer's last: where the model reads the fact back (the position
            # before a token predicts it)
            found[len(ids) - 1:len(ids) + asked + digits - 1] = True
            ids += question
        out.append(torch.tensor(ids[:length], dtype=torch.long))
        marks.append(found)
    return (torch.stack(out), torch.stack(marks)) if with_answers else torch.stack(out)
