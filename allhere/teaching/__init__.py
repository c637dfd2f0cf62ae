"""Routers taught by the full model (AHA without fine-tuning, or before it).

``teach_routers(model, batches, mu_f)`` sets every AHA router of a converted model from the model's own attention
on calibration text, with the weights frozen, so that a share ``mu_f`` of (token, head) pairs goes global
(``teach_alike``: several converted copies of one model, differing in window or sinks, from one pass);
``teaching_windows(tokenizer, text, window)`` makes that text from any text, with facts planted early and asked
for beyond the window (retrieval the router must learn to see). Modules: ``labels`` (what reading locally costs a
(token, head)), ``observe`` (the routed layers' inputs through forward hooks), ``fit`` (a layer's router fitted
to the labels), ``retrieval`` (the calibration windows), ``teach`` (the two passes; static heads
at the same budget: ``allhere.analysis.static.top_k_heads`` of ``Teaching.head_cost``).
"""

from __future__ import annotations

from .retrieval import retrieval_windows
from .teach import Teaching, teach_alike, teach_routers

WINDOWS = 32  # calibration windows of the user's text by default
HAYSTACKS = 32  # and windows of plain sentences said over and over, facts planted in them too
FACTS = 3  # facts planted per window
MARGIN = 16  # a fact's question comes more than window + MARGIN tokens after its statement


def teaching_length(window: int) -> int:
    """Tokens per calibration window for an AHA window of ``window``: 512, or 4 windows where that is longer
    (every window must leave room for facts asked for beyond it)."""
    return max(512, 4 * window)


def teaching_windows(tokenizer, text: str, window: int, count: int = WINDOWS, length: int | None = None,
                     seed: int = 0):
    """(windows [count + HAYSTACKS, length], answers of the same shape) for teaching routers of window ``window``:
    ``count`` windows of the text ``text`` (one document) and ``HAYSTACKS`` of plain sentences said over and over
    (``retrieval.retrieval_windows(..., filler="prose")``: questions asked in natural language after uniform
    filler, where the heads that turn an answer are not only those that read the fact), each with ``FACTS`` facts
    asked for beyond the window, ``answers`` marking the positions that answer them."""
    import torch

    length = length or teaching_length(window)
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    return retrieval_windows(tokenizer, [ids], count, length, window + MARGIN, FACTS, seed, with_answers=True,
                             haystacks=HAYSTACKS, filler="prose")


__all__ = ["Teaching", "teach_alike", "teach_routers", "teaching_length", "teaching_windows", "retrieval_windows"]
