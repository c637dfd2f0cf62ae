"""What the real-model jobs measured of each model, written where users look besides their reports: the held-out
numbers (and AHA's mu_f per layer and head) of every fine-tuning run in the run's TensorBoard events, and the
held-out numbers of every saved model in its model card (the AHA job's and the DAR job's alike).

The cards are first written when a model is saved, before the job measures it (``real_runs.save_model``, with the
numbers of its teaching or training, kept in ``CARD_RECORD`` beside the folder); once the report is written every
card is written again (``allhere.hf.card.write_card``, atomically) with the report's held-out loss, Retain %, mu_f
and passkey count added. A rerun of the job, finished or resumed, writes them again from the same numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

from allhere.hf.card import CARD, Result, write_card
from allhere.runtime.reporting import report_heldout

from .real_runs import CARD_RECORD, MADE_BY


def heldout_events(folder: Path, steps: int, row: dict, model) -> None:
    """A fine-tuning run's measured ``row`` (held-out text and passkey) in the events of the run in ``folder`` at its
    last step, ``steps``: loss, bits per token, mu_f, the passkey count and share (and mu_f on its question), and
    the mu_f heatmap of a routed ``model``."""
    passkey = row.get("passkey") or {}
    numbers = {k: row[k] for k in ("loss", "bits_per_token", "mu_f", "usage") if k in row}
    numbers.update({f"passkey_{k}": passkey.get(k) for k in ("correct", "accuracy", "question_mu_f")})
    report_heldout(folder / "checkpoint.safetensors", steps, numbers, model)


def heldout_results(row: dict, plan: dict) -> list[Result]:
    """The card's rows of a model's row of the report: its held-out loss, Retain % against the control and the
    pretrained model, mu_f there, and passkey retrieval."""
    passkey = row["passkey"]
    text = f"the job's held-out text ({plan['eval_sequences']} windows of {plan['seq_len']} tokens, never trained on)"
    rows = [Result("heldout_loss", row["loss"], f"language-model loss (nats per token) on {text}"),
            Result("retain_vs_control", row["retain_vs_control"], "Retain %: the control's held-out loss over this "
                   "model's, x 100 (the control: the same model, full attention, fine-tuned on the same data)"),
            Result("retain_vs_pretrained", row["retain_vs_pretrained"], "Retain %: the pretrained model's held-out "
                   "loss over this model's, x 100"),
            Result("heldout_mu_f", row["mu_f"], "share of the held-out text's (token, head) pairs on full attention",
                   percent=True),
            Result("passkey_correct", int(passkey["correct"]), f"passkeys found, of {passkey['prompts']} prompts of "
                   f"{plan['passkey_length']} tokens with the key beyond the window")]
    if passkey.get("question_mu_f") is not None:
        rows.append(Result("passkey_question_mu_f", passkey["question_mu_f"], "share of (token, head) pairs on full "
                           "attention over the passkey question's tokens", percent=True))
    return rows


def saved_card(run: Path) -> dict | None:
    """The source, settings and results the card of ``run/model`` was first written with (``CARD_RECORD``); for a
    folder an allhere without that record wrote, its card's front matter (each result named by its key); None
    where the folder has no card (a plain model saved before plain models got theirs)."""
    record = run / CARD_RECORD
    if record.exists():
        saved = json.loads(record.read_text())
        return {**saved, "results": [Result(**r) for r in saved["results"]]}
    if not (run / "model" / CARD).exists():
        return None
    from huggingface_hub import ModelCard

    meta = ModelCard.load(run / "model" / CARD).data.to_dict().get("allhere") or {}
    return {"source": None, "settings": meta.get("run") or {},
            "results": [Result(k, v, k.replace("_", " ")) for k, v in (meta.get("results") or {}).items()]}


def write_cards(task: Path, report: dict) -> list[Path]:
    """Every saved model's card in ``task`` written again with its report row's held-out numbers (the
    results it was saved with first, then these, a key of both replaced). Returns the cards written."""
    return [card for name, row in report["rows"].items()
            if (card := rewrite_card(task / name, heldout_results(row, report["plan"]), report["model"]))]


def rewrite_card(run: Path, results: list[Result], source: str) -> Path | None:
    """``run/model``'s card written again with ``results`` added to the ones it was saved with (a key of both
    replaced); None where ``run`` holds no saved model with a card. ``source``: the base model, where the card's
    record does not name it."""
    from transformers import AutoConfig

    folder = run / "model"
    saved = saved_card(run) if (folder / "config.json").exists() else None
    if saved is None:
        return None
    merged = {r.key: r for r in saved["results"]}
    merged.update({r.key: r for r in results})
    return write_card(folder, AutoConfig.from_pretrained(str(folder)), MADE_BY, source=saved["source"] or source,
                      settings=saved.get("settings"), results=list(merged.values()), shown_as=folder)


def dar_results(row: dict, plan: dict) -> list[Result]:
    """The card's rows of a DAR job's model: its held-out loss, Retain % against the control, and the KV cache it
    keeps per token, short and long."""
    text = f"the job's held-out text ({plan['eval_sequences']} windows of {plan['seq_len']} tokens, never trained on)"
    return [Result("heldout_loss", row["loss"], f"language-model loss (nats per token) on {text}"),
            Result("retain_vs_control", row["retain_vs_control"], "Retain %: the control's held-out loss over this "
                   "model's, x 100 (the control: the same model, plain attention, fine-tuned as stage 2)"),
            Result("kv_bytes_per_token", row["kv_bytes_per_token"], f"KV cache bytes per token after a held-out "
                   f"window of {plan['seq_len']} tokens"),
            Result("kv_bytes_per_token_long", row["kv_bytes_per_token_long"], f"KV cache bytes per token after a "
                   f"prompt of {row['long_tokens']} tokens")]


def dar_heldout(task: Path, runs: dict[str, Path], report: dict) -> None:
    """A DAR job's held-out numbers where users look: per fine-tuning run of ``runs`` (report row -> the run's
    folder) the row's numbers in its TensorBoard events at its last step, and a converted model's card written
    again with them."""
    for name, run in runs.items():
        row = report["rows"][name]
        numbers = {k: row[k] for k in ("loss", "perplexity", "retain_vs_control", "kv_bytes_per_token",
                                       "kv_bytes_per_token_long")}
        report_heldout(run / "checkpoint.safetensors", report["plan"]["dar_steps"], numbers)
        rewrite_card(run, dar_results(row, report["plan"]), report["model"])
