"""``allhere demo --model smollm2 --mechanism dar``: the DAR paper's comparison ("Dual Dimensionality for Local
and Global Attention", arXiv:2606.18587, Tables 1 and 3) on a real pretrained model.

From the pretrained model: DAR(w, d_down = d/4), ``dar_latent`` (w, d_c = d/4, r = head_dim / 16 rotary pairs
per KV head: DAR whose distant keys are scored in the latent with partial RoPE, initialised from the host by
``allhere.hf.convert`` with calibration text) and uniform reduction (every token through the bottleneck, w = 0)
at DAR's KV budget, each fine-tuned in the paper's two stages (1: only the mechanism's weights, at the paper's
3e-4; 2: everything at the model's rate), against the vanilla control fine-tuned for the same stage-2 steps.
Held-out quality as the paper gives it (Rel. % = perplexity / the control's, smaller is better), ``dar_latent``'s
against DAR's, the KV bytes per token each model's cache holds after a held-out window and after a long prompt
(measured on the cache, batch 1), and the decode speed at that long prompt of the control, DAR and
``dar_latent``, each through transformers' forward with its own cache (``real_probes.decode_speed``). Writes
dar_report.md and dar_report.json into ``<out>/dar`` with every model as a transformers folder; each stage-2
run's held-out numbers go into its TensorBoard events and, for a converted model, its model card
(``real_heldout.dar_heldout``).

``dar_latent``'s shape: d_c = d/4 is DAR's latent, so the two differ only in how distant keys get their
position; r = head_dim / 16 is MHA2MLA's choice ("Towards Economical Inference: Enabling DeepSeek's Multi-Head
Latent Attention in Any Transformer-based LLMs", arXiv:2502.14837). Per distant token and layer it keeps
d_c + 2 r kv_heads numbers (SmolLM2-135M: 144 + 24 = 168 of plain's 384, 0.44x), within half of plain.

The same KV budget: DAR's cache keeps every token's latent (d_down numbers per layer) and the full keys and
values of the last w tokens (2 x kv_dim); uniform reduction keeps only latents, so at the held-out length L
it gets d_u = d_down + w x 2 kv_dim / L (rounded up to a multiple of 8): both hold about as many bytes at L.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch

from allhere.hf import cache_nbytes, new_cache
from allhere.hf.cache import cache_kwargs
from allhere.hf.io import check_causal_lm
from allhere.mechanisms import DARConfig, DARLatentConfig
from allhere.runtime.runlock import run_lock

from . import real_runs as runs
from .job import Job
from .real_heldout import dar_heldout
from .real_plan import RealPlan, preset_plan
from .real_probes import decode_speed, heldout, long_prompt
from .real_report import write_dar_report
from .rundir import check_out

CALIBRATION_WINDOWS = 8  # training windows dar_latent's 2-norm pair choice is measured on (never held-out text)


def mechanisms(plan: RealPlan, config) -> dict[str, DARConfig | DARLatentConfig]:
    """DAR(w, d/4), dar_latent(w, d/4, head_dim / 16 pairs) and uniform reduction at DAR's KV budget at
    ``plan.seq_len``."""
    d = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or d // config.num_attention_heads
    kv_dim = config.num_key_value_heads * head_dim
    d_down, pairs = d // 4, max(1, head_dim // 16)
    uniform = min(d, 8 * math.ceil((d_down + plan.window * 2 * kv_dim / plan.seq_len) / 8))
    return {f"DAR w={plan.window} d/4": DARConfig(window=plan.window, d_down=d_down),
            f"DAR latent w={plan.window} d_c={d_down} r={pairs}":
                DARLatentConfig(window=plan.window, d_down=d_down, rope_pairs=pairs),
            f"uniform reduction d={uniform}": DARConfig(window=0, d_down=uniform)}


def folder_of(mech: DARConfig | DARLatentConfig) -> str:
    if isinstance(mech, DARLatentConfig):
        return f"latent-w{mech.window}-d{mech.d_down}-r{mech.rope_pairs}"
    return f"w{mech.window}-d{mech.d_down}"


def two_stages(job: Job, task: Path, mech: DARConfig | DARLatentConfig, base, tokenizer, data, batches,
               plan: RealPlan) -> tuple[object, dict]:
    """(the model, its held-out row): ``base`` converted to ``mech`` (``dar_latent`` initialised from the host
    on the job's calibration windows) and fine-tuned in the paper's two stages in ``task/<folder_of(mech)>``
    (1: only the mechanism's weights, at the paper's rate; 2: everything at the model's), then measured; each
    finished part is read back on a rerun."""
    folder = task / folder_of(mech)
    calibration = calibration_ids(data, plan.seq_len) if isinstance(mech, DARLatentConfig) else None
    first = runs.fine_tune(folder / "stage1", base, mech, runs.train_config(plan, plan.dar_steps, plan.dar_stage1_lr),
                           batches, tokenizer, job, train_only=".allhere.", calibration=calibration)
    second = runs.fine_tune(folder / "stage2", base, mech, runs.train_config(plan, plan.dar_steps, plan.lr), batches,
                            tokenizer, job, start=first)
    return second, held_out_row(job, task, folder_of(mech), second, data, plan)


def held_out_row(job: Job, task: Path, name: str, model, data, plan: RealPlan) -> dict:
    """``model``'s held-out stage, kept as ``task/results/<name>.json`` (read back on a rerun)."""
    return runs.stage(task, name, lambda: _measure(job, task, name, model, data, plan.device, plan.speed_prompt))


def calibration_ids(data, seq_len: int, count: int = CALIBRATION_WINDOWS) -> torch.Tensor:
    """[count, seq_len]: the first window of the first ``count`` training documents (calibration text)."""
    return torch.stack([doc[:seq_len] for doc in data.train[:count]])


def run_real_dar(model: str = "smollm2", out: str | Path = "runs/smollm2", preset: str | None = None,
                 device: str = "cpu", data_path: str | None = None, progress: bool = True, log=print) -> dict:
    """Run (or continue) the DAR comparison in ``out/dar``; write its report there; return it."""
    plan = preset_plan(preset or ("gpu" if device.startswith("cuda") else "cpu"), device)
    source = runs.resolve_model(model, progress, log)
    config = check_causal_lm(source)
    mechs = mechanisms(plan, config)
    for mech in mechs.values():
        check_causal_lm(source, convertible=True, mechanism=mech)
    check_out(out)
    task = Path(out) / "dar"
    t0 = time.time()
    with run_lock(out):
        tokenizer, base, data = runs.load_and_claim(task, "dar", source, plan, device, data_path, log)
        stage1 = runs.train_config(plan, plan.dar_steps, plan.dar_stage1_lr)
        stage2 = runs.train_config(plan, plan.dar_steps, plan.lr)
        job = Job(progress)
        runs.plan_run(job, task / "control", stage2, base, plan.seq_len)
        for mech in mechs.values():
            runs.plan_run(job, task / folder_of(mech) / "stage1", stage1, base, plan.seq_len)
            runs.plan_run(job, task / folder_of(mech) / "stage2", stage2, base, plan.seq_len)
        for name in ("pretrained", "control", *map(folder_of, mechs.values())):
            runs.plan_work(job, task, name, plan.eval_sequences + 1, runs.token_cost(base, plan.seq_len, plan.seq_len))
        long = plan.speed_prompt + (plan.speed_tokens + 2) * runs.DECODE_TOKENS
        runs.plan_work(job, task, "speed", SPEED_ROWS, runs.token_cost(base, long, plan.speed_prompt))
        batches = data.batches(plan.batch_size, plan.seq_len)

        rows = {"vanilla (pretrained)": held_out_row(job, task, "pretrained", base, data, plan)}
        control = runs.fine_tune(task / "control", base, None, stage2, batches, tokenizer, job)
        rows["vanilla (+ stage-2 steps, control)"] = held_out_row(job, task, "control", control, data, plan)
        timed = {"plain (control)": control}
        for label, mech in mechs.items():
            model, rows[label] = two_stages(job, task, mech, base, tokenizer, data, batches, plan)
            if mech.window:  # DAR and dar_latent are timed; uniform reduction is not
                timed[SPEED_MODELS[type(mech)]] = model
            del model
        speed = runs.stage(task, "speed", lambda: _speed(job, task, timed, data, device, plan))
        timed.clear()
        report = summarize(plan, rows, speed, mechs, data.description, str(source))
        report["seconds_this_call"] = round(time.time() - t0, 1)
        write_dar_report(task, report)
        finished = {"vanilla (+ stage-2 steps, control)": task / "control",
                    **{label: task / folder_of(mech) / "stage2" for label, mech in mechs.items()}}
        dar_heldout(task, finished, report)  # each run's events and each converted model's card
    return report


@torch.inference_mode()
def kv_bytes_per_token(model, ids: torch.Tensor) -> float:
    """Bytes the model's cache keeps per token after a prefill of ``ids`` [1, n]: a converted model's own cache
    (``allhere.hf.new_cache``; DAR's latents, near keys and absorbed weights), a plain model's DynamicCache."""
    from transformers.cache_utils import DynamicCache

    from allhere.mechanisms.base import mechanism_layers

    cache = new_cache(model) if mechanism_layers(model) else DynamicCache(config=model.config)
    model(ids, use_cache=True, logits_to_keep=1, **cache_kwargs(cache))
    return cache_nbytes(cache, used=True) / ids.shape[1]


def _measure(job: Job, task: Path, name: str, model, data, device: str, long: int) -> dict:
    """Held-out loss and perplexity; the KV bytes per token after a held-out window and after a ``long`` prompt
    (where the window's full keys and the absorbed weights weigh less)."""
    bar = runs.work_bar(job, task, name, len(data.heldout) + 1)
    losses = []
    for window in data.heldout.split(1):
        losses.append(heldout(model, window, device)["loss"])
        bar.update(1)
    row = {"loss": sum(losses) / len(losses)}
    row["perplexity"] = math.exp(row["loss"])
    row["kv_bytes_per_token"] = kv_bytes_per_token(model, data.heldout[:1].to(device))
    row["kv_bytes_per_token_long"] = kv_bytes_per_token(model, long_prompt(data.heldout_docs, long).to(device))
    row["long_tokens"] = long
    bar.update(1)
    bar.close()
    return row


SPEED_MODELS = {DARConfig: "DAR", DARLatentConfig: "DAR latent"}  # besides the control: the models timed
SPEED_ROWS = len(SPEED_MODELS) + 2  # the control on two caches, each of the others on its own


def _speed(job: Job, task: Path, models: dict, data, device: str, plan: RealPlan) -> dict:
    """Decode at a ``plan.speed_prompt``-token held-out prompt, each model through transformers' forward with its
    own cache (the control on transformers' DynamicCache and on allhere's in-place one), in one stage so that
    all share the machine's load; ms per step is the median of ``plan.speed_tokens`` greedy steps."""
    bar = runs.work_bar(job, task, "speed", SPEED_ROWS)
    ids = long_prompt(data.heldout_docs, plan.speed_prompt)
    before = list(os.getloadavg())
    rows = []
    for name, model in models.items():
        for row in decode_speed(model, ids, plan.speed_tokens, device):
            rows.append({"model": name, **row})
            bar.update(1)
    bar.close()
    plain = next(r["ms_per_step"] for r in rows if r["model"] == "plain (control)" and "DynamicCache" in r["cache"])
    for r in rows:
        r["speedup"] = plain / r["ms_per_step"]  # against the control on transformers' default cache
    return {"rows": rows, "load_average_before": before, "load_average_after": list(os.getloadavg())}


def summarize(plan: RealPlan, rows: dict, speed: dict, mechs: dict, data: str, source: str) -> dict:
    control = rows["vanilla (+ stage-2 steps, control)"]
    for r in rows.values():
        r["rel_percent"] = 100.0 * r["perplexity"] / control["perplexity"]
        r["retain_vs_control"] = 100.0 * control["loss"] / r["loss"]
        r["kv_vs_plain"] = r["kv_bytes_per_token"] / control["kv_bytes_per_token"]
        r["kv_vs_plain_long"] = r["kv_bytes_per_token_long"] / control["kv_bytes_per_token_long"]
    label = {("latent" if isinstance(m, DARLatentConfig) else "dar" if m.window else "uniform"): k
             for k, m in mechs.items()}
    dar, latent, uniform = (rows[label[k]] for k in ("dar", "latent", "uniform"))
    latent["retain_vs_dar"] = 100.0 * dar["loss"] / latent["loss"]  # the quality DAR as the paper defines it keeps
    latent["rel_vs_dar"] = 100.0 * latent["perplexity"] / dar["perplexity"]
    ms = {r["model"]: r["ms_per_step"] for r in speed["rows"]}
    plain_ms = next(r["ms_per_step"] for r in speed["rows"]
                    if r["model"] == "plain (control)" and "DynamicCache" in r["cache"])
    n = dar["long_tokens"]
    goals = {"DAR keeps >= 99% of the control's held-out quality (loss ratio)": dar["retain_vs_control"] >= 99.0,
             "uniform reduction at the same KV budget below DAR": uniform["loss"] > dar["loss"],
             f"DAR's KV bytes per token at {n} tokens <= 0.5x the plain model's": dar["kv_vs_plain_long"] <= 0.5,
             "dar_latent keeps >= 99% of DAR's held-out quality (loss ratio)": latent["retain_vs_dar"] >= 99.0,
             f"dar_latent's KV bytes per token at {n} tokens <= 0.5x the plain model's":
                 latent["kv_vs_plain_long"] <= 0.5,
             f"dar_latent decodes faster than DAR at {plan.speed_prompt} tokens": ms["DAR latent"] < ms["DAR"],
             f"dar_latent decodes at least as fast as the plain model (DynamicCache) at {plan.speed_prompt} tokens":
                 ms["DAR latent"] <= plain_ms}
    return {"model": source, "plan": plan.to_dict(), "data": data, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "load_average_after": list(os.getloadavg()), "rows": rows,
            "labels": label, "speed": speed, "goals": goals}
