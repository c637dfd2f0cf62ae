"""The real-model jobs' reports: report.md and report.json (and AHA's mu_f_heatmap.png) in the job's folder."""

from __future__ import annotations

from pathlib import Path

from .report import goal_lines, percent, write_report

AHA_ROWS = (("pretrained", "pretrained"), ("control", "control: full attention, fine-tuned"),
            ("taught", "AHA, routers taught by the full model, no fine-tuning"),
            ("static", "static heads at the taught routers' mu_f (the same weights)"),
            ("taught-nosinks", "AHA, routers taught, no sinks"),
            ("aha", "**AHA, fine-tuned from the taught routers**"),
            ("aha-paper", "AHA, the paper's recipe (routers open, no sinks, fine-tuned)"))
CHATS = (("pretrained", "pretrained"), ("control", "control"), ("aha", "AHA, fine-tuned"))


def _mu(r: dict) -> str:
    return percent(r["mu_f"]) if r.get("mu_f") is not None else "-"


def _passkey(r: dict) -> str:
    p = r["passkey"]
    asked = f", question {percent(p['question_mu_f'])}" if p.get("question_mu_f") is not None else ""
    return f"{p['correct']}/{p['prompts']}{asked}"


def _haystacks(plan: dict) -> str:
    """The haystacks beside the calibration windows, in words ("" for none, or a run saved before them)."""
    count = plan.get("calib_haystacks", 0)
    if not count:
        return ""
    kind = "plain sentences" if plan.get("calib_filler") == "prose" else "a short run of the text"
    return f" and {count} of {kind} said over and over,"


def render_aha(report: dict) -> str:
    plan, rows = report["plan"], report["rows"]
    aha, taught = rows["aha"], rows["taught"]
    out = ["# AHA on a real pretrained model", "",
           f"Model: `{report['model']}`. Data: {report['data']}.", "",
           f"Window w = {plan['window']}, {plan['sinks']} sink token(s) in the local branch, {plan['seq_len']}-token "
           f"sequences. Taught routers: {plan['calib_windows']} calibration windows of the training text"
           + _haystacks(plan) + f" with {plan['calib_facts']} planted fact(s) each, budget mu_f "
           f"{percent(plan['mu_f'])} there. Fine-tuning: {plan['steps']} steps of "
           f"{plan['batch_size'] * plan['grad_accum']} sequence(s), AdamW {plan['lr']:g}; from the taught routers "
           f"routers x{plan['taught_router_lr_mult']:g}, lambda {plan['taught_lam']:g}"
           + (f" steered to mu_f {percent(plan['taught_target_mu_f'])}" if plan.get("taught_target_mu_f") else "")
           + f"; the paper's recipe routers x{plan['router_lr_mult']:g}, lambda from {plan['lam']:g}"
           + (f" steered to mu_f {percent(plan['target_mu_f'])}" if plan.get("target_mu_f") else "")
           + f". Device {plan['device']}, torch {report['torch']}, {report['threads']} threads.", "",
           "## Held-out quality, mu_f and passkey retrieval", "",
           "| model | held-out loss (nats/token) | Retain % vs control | Retain % vs pretrained | mu_f | passkey "
           "(mu_f on its question) |",
           "|---|---|---|---|---|---|"]
    table = [(label, rows[key]) for key, label in AHA_ROWS]
    table.insert(3, ("AHA with every gate local (the window and the sinks), pretrained weights", taught["all_local"]))
    table.append(("AHA fine-tuned with every gate local", aha["all_local"]))
    table.append(("AHA fine-tuned with every gate global (full attention, its weights)", aha["all_global"]))
    for label, r in table:
        out.append(f"| {label} | {r['loss']:.4f} | {r['retain_vs_control']:.1f}% | {r['retain_vs_pretrained']:.1f}% "
                   f"| {_mu(r)} | {_passkey(r)} |")
    teaching = taught["teaching"]
    tail = aha["long_tail"]
    out += ["", f"Passkey: {plan['passkey_prompts']} prompts of {plan['passkey_length']} tokens, the key said "
                f"between {2 * plan['window']} tokens before the end and the prompt's start (beyond the window); "
                f"AHA fine-tuned reads {_mu(aha['passkey'])} of its pairs globally while it answers and "
                f"{percent(aha['passkey'].get('prompt_mu_f') or 0.0)} over the prompts.", "",
            "## Taught routers", "",
            f"Taught in {teaching['seconds']:.0f} s (beside the routers without sinks, from the same pass) on "
            f"{teaching['tokens']:,} calibration tokens: mu_f "
            f"{percent(teaching['mu_f'])} there, {percent(teaching['answer_mu_f'] or 0.0)} on the tokens that ask for "
            f"a planted fact; of the pairs beyond the window the full model's attention needs most, the routers send "
            f"{percent(teaching['recall'])} to full attention. The static heads: the {rows['static']['heads']} heads "
            "the teacher finds costliest to read locally, global on every token, the others local.", "",
            "## The long tail", "",
            f"Of {tail['heads']} (layer, head) pairs of AHA fine-tuned, the busiest {tail['busiest_heads']} (10%) make "
            f"{percent(tail['busiest_share_of_global_calls'])} of the global calls on held-out text; "
            f"{tail['heads_global_half_the_time']} heads are global on at least half of the tokens, "
            f"{tail['heads_never_global']} never. mu_f per layer and head: mu_f_heatmap.png.", "",
            "## Decode speed at a long prompt", "",
            "| model | cache | prompt tokens | prefill s | ms per step | tokens/s | x plain (fastest) | mu_f |",
            "|---|---|---|---|---|---|---|---|"]
    for r in report["speed"]["rows"]:
        out.append(f"| {r['model']} | {r['cache']} | {r['prompt_tokens']} | {r['prefill_s']:.2f} | "
                   f"{r['ms_per_step']:.1f} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {_mu(r)} |")
    out += ["", "## Chat", ""]
    chats = {label: rows[key]["chat"]["replies"] for key, label in CHATS}
    for i, prompt in enumerate(rows["pretrained"]["chat"]["prompts"]):
        out += [f"**{prompt}**", ""] + [f"- *{label}*: {replies[i]!r}" for label, replies in chats.items()] + [""]
    out += ["## Goals", ""] + goal_lines(report["goals"])
    out += ["", "Retain % = the other model's held-out loss / this row's (higher is better); mu_f = share of "
                "(token, head) pairs on full attention (the AHA paper's Eq. 8)."]
    return "\n".join(out) + "\n"


def write_aha_report(task: Path, report: dict) -> dict[str, Path]:
    paths = write_report(task, "report", report, render_aha(report))
    from allhere.analysis.plots import usage_heatmaps

    rows = report["rows"]
    paths["png"] = usage_heatmaps({"AHA fine-tuned, held-out text": rows["aha"]["usage"],
                                   "taught routers, held-out text": rows["taught"]["usage"]},
                                  Path(task) / "mu_f_heatmap.png")
    return paths


def render_dar(report: dict) -> str:
    plan = report["plan"]
    out = ["# DAR on a real pretrained model", "",
           f"Model: `{report['model']}`. Data: {report['data']}.", "",
           f"{plan['seq_len']}-token held-out windows; each DAR model fine-tuned {plan['dar_steps']} steps in stage 1 "
           f"(the bottleneck only, lr {plan['dar_stage1_lr']:g}) and {plan['dar_steps']} in stage 2 (everything, lr "
           f"{plan['lr']:g}); the control {plan['dar_steps']} steps at lr {plan['lr']:g}. Device {plan['device']}, "
           f"torch {report['torch']}, {report['threads']} threads.", "",
           "| model | held-out loss | perplexity | Rel. % (vs control, smaller is better) | Retain % vs control "
           f"| KV bytes / token at {plan['seq_len']} | x plain | at {plan['speed_prompt']} | x plain |",
           "|---|---|---|---|---|---|---|---|---|"]
    for name, r in report["rows"].items():
        out.append(f"| {name} | {r['loss']:.4f} | {r['perplexity']:.3f} | {r['rel_percent']:.2f}% | "
                   f"{r['retain_vs_control']:.1f}% | {r['kv_bytes_per_token']:,.0f} | {r['kv_vs_plain']:.2f}x | "
                   f"{r['kv_bytes_per_token_long']:,.0f} | {r['kv_vs_plain_long']:.2f}x |")
    out += ["", "KV bytes per token: what each model's cache keeps after a held-out window (and after a longer "
                "held-out prompt), divided by its tokens, float32 (DAR: every token's latent, the last w tokens' "
                "keys and values, and its absorbed weights, a constant per layer; DAR latent: every token's latent "
                "and kept rotary pairs, the last w tokens' keys and values)."]
    latent = report["rows"][report["labels"]["latent"]] if "labels" in report else None
    if latent is not None:
        out += ["", "## DAR latent against DAR", "",
                f"{report['labels']['latent']} keeps {latent['retain_vs_dar']:.1f}% of the held-out quality of "
                f"{report['labels']['dar']} (DAR as the paper defines it; loss ratio, higher is better); its "
                f"perplexity is {latent['rel_vs_dar']:.2f}% of DAR's (smaller is better)."]
    speed = report.get("speed")
    if speed:
        out += ["", f"## Decode speed at a {speed['rows'][0]['prompt_tokens']}-token prompt", "",
                "| model | cache | prefill s | ms per step | tokens/s | x plain (DynamicCache) |",
                "|---|---|---|---|---|---|"]
        for r in speed["rows"]:
            out.append(f"| {r['model']} | {r['cache']} | {r['prefill_s']:.2f} | {r['ms_per_step']:.1f} | "
                       f"{r['tokens_per_s']:.1f} | {r['speedup']:.2f}x |")
        load = ", ".join(f"{x:.2f}" for x in speed["load_average_before"])
        out += ["", f"Median of {speed['rows'][0]['steps']} greedy steps after two untimed ones, each model through "
                    f"transformers' forward with its own cache; load average before: {load}."]
    out += ["", "## Goals", ""] + goal_lines(report["goals"])
    return "\n".join(out) + "\n"


def write_dar_report(task: Path, report: dict) -> dict[str, Path]:
    return write_report(task, "dar_report", report, render_dar(report))
