"""The model card (README.md) of a model folder allhere writes -- ``allhere convert``, ``allhere sft``
(``allhere.hf.sft``) and the real-model job's models: what the folder holds (the mechanism and its settings as the
saved config has them), what the run that wrote it measured, how to load, generate with and serve it.

Written with huggingface_hub's own ``ModelCard`` / ``ModelCardData`` (a dependency of transformers, so there
wherever ``allhere.hf`` is), so that the Hub parses its front matter:

- ``library_name: transformers``: the files are transformers' own (config.json, safetensors, the tokenizer), and
  every host of the folder (transformers, vLLM) reads them. transformers alone loads the host model without the
  mechanism (the added weights reported unused); ``allhere.hf.load_pretrained`` loads it whole: the body says so.
- ``base_model``: a Hugging Face Hub id only, never a local path (which the Hub refuses): ``base_model_of``.
- ``pipeline_tag: text-generation``; ``tags``: allhere and the mechanism's kind; ``allhere``: the mechanism's
  settings (config.json's ``allhere_mechanism``), the converted layers, the run's settings and its results.

A number appears only where the run computed it (``Result``): the card never estimates one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .. import registry
from ..hosts import CONFIG_KEY, LAYERS_KEY
from ..runtime.model_checkpoint import atomic_write

CARD = "README.md"
BASE_HEADING = "## The base model's card"
# The input model's card: its body is kept under BASE_HEADING (its headings two levels down). Of its front matter
# only what still holds for a model derived from it is merged into ours: its license and the languages it reads.
# The rest (its tags, pipeline, model-index metrics, widgets, datasets, base_model) describes the base model, not
# this one, and is dropped deliberately (the base model's own page keeps it).
KEPT_FROM_BASE = ("license", "license_name", "license_link", "language")
# org/name as the Hub spells a model id (one slash, no "--" nor ".."); a bare name is more likely a local folder
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")


@dataclass(frozen=True)
class Result:
    """A number the run that wrote the folder computed."""

    key: str  # its name under ``allhere: results:`` in the front matter
    value: float | int
    about: str  # what it is: what was measured, on what
    percent: bool = False  # a share, shown as a percentage

    def shown(self) -> str:
        if self.percent:
            return f"{100 * self.value:.1f}%"
        return f"{self.value:,}" if isinstance(self.value, int) else f"{self.value:.4g}"


def training_results(state: dict, routed: bool) -> list[Result]:
    """The numbers of a training run's final state (``allhere.train.train``'s): its steps, its last step's LM loss
    on that step's batch, mu_f there where the model ``routed`` (else the logged 1.0 is no measurement), and the
    lambda the run steered to where it steered one."""
    rows = [Result("steps", int(state["step"]), "optimizer steps trained")]
    last = state["history"][-1] if state.get("history") else None
    if last is not None:
        rows.append(Result("last_step_loss", last["lm"], "language-model loss (nats per trained token) of the last "
                                                         "step, on its own training batch"))
        if routed and last.get("mu_f") is not None:
            rows.append(Result("last_step_mu_f", last["mu_f"], "share of (token, head) pairs on full attention in "
                                                               "the last step's batch", percent=True))
    if state.get("lam") is not None:
        rows.append(Result("final_lambda", state["lam"], "lambda the run steered to (towards its mu_f target)"))
    return rows


def teaching_results(taught) -> list[Result]:
    """The numbers of routers taught by the model itself (an ``allhere.teaching.Teaching``), on its calibration text."""
    rows = [Result("calibration_mu_f", taught.mu_f, "share of the calibration text's (token, head) pairs the taught "
                                                    "routers send to full attention", percent=True)]
    if taught.answer_mu_f is not None:
        rows.append(Result("calibration_answer_mu_f", taught.answer_mu_f, "the same share where a planted fact is "
                                                                          "answered", percent=True))
    rows.append(Result("calibration_recall", taught.recall, "of the pairs the full model's attention needs most, the "
                                                            "share sent to full attention", percent=True))
    return rows


def _front_matter(readme: Path) -> tuple[dict, str]:
    """(front matter, body) of a README: the raw text with no front matter where it has none or one that does not
    parse (kept whole, never lost)."""
    from huggingface_hub import ModelCard

    raw = readme.read_text(encoding="utf-8", errors="replace")
    try:
        card = ModelCard(raw)
    except Exception:  # front matter that is not YAML, or not a mapping: the text as it is
        return {}, raw
    return card.data.to_dict(), card.text


def _hub_id(value) -> str | None:
    if not isinstance(value, str) or not _HUB_ID.fullmatch(value) or "--" in value or ".." in value:
        return None
    return None if value.endswith(".git") or Path(value).exists() else value


def base_model_of(source: str | Path | None) -> str | None:
    """The Hub id of the model at ``source`` (a folder or a file), where it can be known: a known model's cached
    file (``allhere fetch``: the model it was made from); a folder in huggingface_hub's cache
    (``.../models--ORG--NAME/snapshots/REV``); a config.json whose ``_name_or_path`` is an ``org/name`` that is no
    local path (transformers before 5 wrote it); an allhere card's own ``base_model`` (a model allhere wrote, fine-
    tuned again: the nearest ancestor on the Hub). None otherwise."""
    import json

    from ..runtime.models_cache import KNOWN, known_file

    if source is None:
        return None
    p = Path(source)
    name = known_file(p) if p.is_file() else None
    if name is not None:
        return KNOWN[name].hub_id or None
    parts = p.resolve().parts
    for i, part in enumerate(parts[:-2]):
        if part.startswith("models--") and parts[i + 1] == "snapshots":
            found = _hub_id(part.removeprefix("models--").replace("--", "/", 1))
            if found:
                return found
    if (p / "config.json").is_file():
        try:
            found = _hub_id(json.loads((p / "config.json").read_text()).get("_name_or_path"))
        except (OSError, ValueError, AttributeError):
            found = None
        if found:
            return found
    if (p / CARD).is_file():
        meta, _ = _front_matter(p / CARD)
        if "allhere" in (meta.get("tags") or []):
            return _hub_id(meta.get("base_model"))
    return None


def _demoted(text: str) -> str:
    """Markdown ``text`` with every heading two levels down (at most 6; not inside code fences), to sit under a
    ``##`` heading."""
    out, fence = [], None
    for line in text.splitlines():
        mark = re.match(r"\s*(```|~~~)", line)
        if mark:
            fence = None if fence == mark.group(1) else (fence or mark.group(1))
        elif fence is None and re.match(r"#{1,6} ", line):
            hashes = len(line) - len(line.lstrip("#"))
            line = "#" * min(6, hashes + 2) + line[hashes:]
        out.append(line)
    return "\n".join(out).strip()


def _layers(config, chosen) -> str:
    total = getattr(config, "num_hidden_layers", None)
    if total is not None and list(chosen) == list(range(total)):
        return f"all {total}"
    return f"{len(chosen)} of {total} ({', '.join(map(str, chosen))})" if total else ", ".join(map(str, chosen))


def _usage(folder: str, serving: bool, authors_format: bool, plain: bool = False) -> str:
    alone = ("transformers alone reads this format (the AHA authors' faolmo) only with their remote code"
             if authors_format else "transformers alone loads it as it is (no allhere mechanism)" if plain else
             "With transformers alone the folder loads as the host model without its mechanism (the added weights "
             "reported unused)")
    lines = ["## Use it", "",
             "allhere reads local folders only (`hf download REPO --local-dir FOLDER` first for a copy from the Hub). "
             f"{alone}; `allhere.hf.load_pretrained` loads it whole (no `trust_remote_code`). "
             "Needs allhere with its `hf` extra (`pip install 'allhere[hf]'`).", "",
             "```python", "import allhere  # noqa: F401", "from allhere.hf import load_pretrained",
             "from transformers import AutoTokenizer", "",
             f"tokenizer = AutoTokenizer.from_pretrained({folder!r})",
             f"model = load_pretrained({folder!r})  # kwargs go to from_pretrained, e.g. dtype=torch.bfloat16",
             'ids = tokenizer("The capital of France is", return_tensors="pt").input_ids',
             "print(tokenizer.decode(model.generate(ids, max_new_tokens=20)[0]))", "```", "",
             "```bash",
             f"allhere generate --model {folder} --prompt 'The capital of France is' --max-new-tokens 20",
             f"allhere generate --model {folder} --chat        # one user turn per line of stdin",
             f"allhere perplexity --model {folder} --data texts/   # held-out loss and mu_f on your text"]
    if serving:
        lines += [f"allhere serve --model {folder}   # vLLM's OpenAI-compatible server (vLLM and allhere's plugin)"]
    lines += ["```"]
    if not serving:
        lines += ["", "`allhere serve` does not serve this mechanism (yet); transformers and allhere do."]
    return "\n".join(lines)


def write_card(folder: str | Path, config, made_by: str, source: str | Path | None = None,
               settings: dict | None = None, results: list[Result] | tuple = (), shown_as: str | Path | None = None
               ) -> Path:
    """Write ``folder/README.md`` (atomically) for the converted model of transformers ``config`` (its
    ``allhere_mechanism``; a config without one: a plain model allhere fine-tuned, a job's control), written by
    ``made_by`` (e.g. "allhere convert") from the model at ``source`` (default: ``config.name_or_path``, where
    transformers' loader put the path it read), with the run's ``settings`` (name -> value) and ``results``.
    ``shown_as``: the folder's path in the card's commands (default ``folder``; the final name of a folder written
    under a temporary one). An input folder's own README.md is kept under BASE_HEADING. Returns the card's path."""
    from huggingface_hub import ModelCard, ModelCardData

    saved_mech = getattr(config, CONFIG_KEY, None)
    mech = registry.from_dict(saved_mech) if saved_mech is not None else None  # None: a plain model (a control)
    kind = registry.get(mech.kind) if mech is not None else None
    settings_of = {k: v for k, v in registry.to_dict(mech).items() if k != "kind"} if mech is not None else {}
    chosen = list(getattr(config, LAYERS_KEY, None) or [])
    source = source if source is not None else (getattr(config, "name_or_path", "") or None)
    base_id = base_model_of(source)
    base_meta, base_text = {}, None
    if source is not None and (Path(source) / CARD).is_file():
        base_meta, base_text = _front_matter(Path(source) / CARD)
    known = None
    if source is not None and Path(source).is_file():
        from ..runtime.models_cache import KNOWN, known_file

        known = KNOWN.get(known_file(source) or "")
    run = {k: v for k, v in (settings or {}).items() if v is not None}
    meta = {k: base_meta[k] for k in KEPT_FROM_BASE if base_meta.get(k)}
    if known is not None and known.license and "license" not in meta:
        meta["license"] = known.license
    data = ModelCardData(base_model=base_id, library_name="transformers", pipeline_tag="text-generation",
                         tags=["allhere"] + ([mech.kind] if mech is not None else []), **meta,
                         allhere={"mechanism": registry.to_dict(mech) if mech is not None else None, "layers": chosen,
                                  "made_by": made_by,
                                  **({"run": run} if run else {}),
                                  **({"results": {r.key: r.value for r in results}} if results else {})})
    shown = str(shown_as if shown_as is not None else folder)
    name = base_id.split("/")[-1] if base_id else (Path(source).name if source is not None else "A model")
    dtype = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "").removeprefix("torch.")
    origin = (f" from `{Path(source).name}` (on the Hub: [{base_id}](https://huggingface.co/{base_id}))" if base_id
              else "") + "."
    if mech is None:
        body = [f"# {name}, fine-tuned (allhere)", "",
                f"{name} with its own attention (no allhere mechanism), written by `{made_by}`{origin}"]
    else:
        body = [f"# {name} with {mech.kind} attention (allhere)", "",
                f"{name} converted by allhere to `{mech.kind}` attention: {kind.summary}. Written by `{made_by}`"
                + origin]
    body += ["", "## What it holds", "", "| setting | value |", "|---|---|"]
    body += [f"| `{k}` | {v} |" for k, v in settings_of.items()]
    if chosen:
        body.append(f"| layers converted | {_layers(config, chosen)} |")
    if dtype:
        body.append(f"| weights | {dtype} |")
    body += [f"| {k} | {v} |" for k, v in run.items()]
    body += ["", "## What the run measured", ""]
    if results:
        body += ["| | |", "|---|---|", *[f"| {r.about} | {r.shown()} |" for r in results]]
    else:
        body.append(f"`{made_by}` measured nothing on this model; `allhere perplexity --model {shown} --data texts/` "
                    "measures its held-out loss (and mu_f, where it routes) on your text.")
    from .faolmo import read_config as faolmo_config

    body += ["", _usage(shown, kind is None or kind.serving is not None, faolmo_config(Path(folder)) is not None,
                        plain=mech is None)]
    if base_text is not None:
        body += ["", BASE_HEADING, "", _demoted(base_text) or "(empty)"]
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body) + "\n")
    path = Path(folder) / CARD
    atomic_write(path, lambda tmp: card.save(tmp))
    return path
