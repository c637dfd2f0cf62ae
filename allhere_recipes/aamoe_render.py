"""The markdown report of the AA-MoE experiment (``allhere_recipes.aamoe``): every number as the mean
and standard deviation over the seeds that have finished, and the runs still missing."""

from __future__ import annotations

from .report import goal_lines


def ms(s: dict | None, digits: int = 4, scale: float = 1.0) -> str:
    """A ``stat`` as "mean ± sd" ("mean" for one seed, "-" when not measured)."""
    if not s:
        return "-"
    text = f"{scale * s['mean']:.{digits}f}"
    return text if s["std"] is None else f"{text} ± {scale * s['std']:.{digits}f}"


def pct(s: dict | None) -> str:
    return "-" if not s else f"{ms(s, 1, 100)}%"


def render(report: dict) -> str:
    rows = report["rows"]
    dense = rows.get("dense")
    out = [f"# AA-MoE against dense, All-Attention, context-only and experts-only ({report['task']} task)", "",
           f"Preset `{report['preset']}`: {report['data']}. Plan: `{report['plan']}`. Seeds: "
           f"{', '.join(map(str, report['seeds']))}.", "",
           "Every number is the mean ± the standard deviation over the finished seeds (one number: one seed). "
           "bits/byte on held-out windows with the causal budget predictor (the honest number); \"seq. budgets\" "
           "uses the non-causal sequence-level budgets the models were trained with. FLOPs per token: forward, "
           "counted from what runs (keys actually read), the output head included.", "",
           "| model | seeds | params | FLOPs/token | FLOPs vs dense | bits/byte | bits/byte, seq. budgets | "
           "2x length | 4x length | budget B/2 | budget 2B |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        vs = f"{100 * r['flops_per_token']['mean'] / dense['flops_per_token']['mean']:.0f}%" if dense else "-"
        out.append(f"| {name} | {len(r['seeds'])} | {r['params']['mean']:,.0f} | "
                   f"{r['flops_per_token']['mean'] / 1e3:.0f}k | {vs} | {ms(r['bpb'])} | {ms(r.get('bpb_sequence'))} | "
                   f"{ms(r.get('bpb_2x'))} | {ms(r.get('bpb_4x'))} | {ms(r.get('bpb_budget_half'))} | "
                   f"{ms(r.get('bpb_budget_double'))} |")
    if any("acc_table" in r for r in rows.values()):
        out += ["", "Accuracy per kind of query (both answer bytes right, teacher-forced argmax; chance: table "
                "1/676, context 1/100), causal budgets:", "",
                "| model | table (a) | context (b) | table 2x | context 2x | table 4x | context 4x | table B/2 | "
                "context B/2 | table 2B | context 2B |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, r in rows.items():
            cells = [pct(r.get(f"acc_{k}{s}")) for s in ("", "_2x", "_4x", "_budget_half", "_budget_double")
                     for k in ("table", "context")]
            out.append(f"| {name} | " + " | ".join(cells) + " |")
    out += ["", "Per AA-MoE layer (sequence-level budgets, over seeds): mean B_i, share of the chosen resources "
            "that are context chunks / experts, histogram of B_i summed over seeds (tokens with 0, 1, 2, ... "
            "resources, in %), and the drift of the causal predictor (mean |B^_i - B_i|, share of tokens with "
            "B^_i = B_i):", "",
            "| model | layer | mean B_i | context | experts | histogram of B_i | drift mean abs | drift equal |",
            "|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        for i, lay in enumerate(r.get("layers", [])):
            n = max(1, sum(lay["budget_histogram"]))
            hist = " / ".join(f"{100 * c / n:.0f}" for c in lay["budget_histogram"][:9])
            out.append(f"| {name} | {i} | {ms(lay['mean_budget'], 2)} | {pct(lay['context_share'])} | "
                       f"{pct(lay['expert_share'])} | {hist} | {ms(lay['drift_mean_abs'], 2)} | "
                       f"{pct(lay['drift_equal'])} |")
    out += ["", "Per seed (causal bits/byte" + (", table / context accuracy" if report["task"] == "mixed" else "")
            + "):", ""]
    for name, by_seed in report["runs"].items():
        cells = [f"seed {s}: {r['bpb']:.4f}" + (f" ({100 * r['acc_table']:.0f}% / {100 * r['acc_context']:.0f}%)"
                                                  if "acc_table" in r else "") for s, r in by_seed.items()]
        out.append(f"- {name}: " + "; ".join(cells))
    out += ["", "Runs not finished (run the same command again, or with `--models` / `--seeds`, to train them):"]
    out += [f"- {m['model']}, seed {m['seed']}: {m['state']}" + (f" ({m['step']} steps done)" if m["step"] else "")
            for m in report["missing"]] or ["- none"]
    out += ["", *decision_lines(report["decision"]), "", f"**Verdict on this task: {report['verdict']}.**"]
    out += ["", "Goals (on the seed means):"] + goal_lines(report["goals"])
    if report.get("plots"):
        out += [""] + [f"![{p}]({p})" for p in report["plots"]]
    out.append(f"\n{report['seconds']:.0f} s.")
    return "\n".join(out) + "\n"


def decision_lines(decision: dict) -> list[str]:
    """The comparisons of docs/aamoe.md "Deciding the claim": gain of the reference, margin, verdict."""
    ref = decision["reference"]
    out = [f"Deciding the claim (docs/aamoe.md): {ref} against each row; gain = how much lower its bits/byte "
           "(higher accuracy) is, margin = 2 x the larger standard deviation over seeds:", ""]
    for c in decision["comparisons"] + decision["predictions"]:
        gain = f"gain {c['gain']:+.4f}" if "gain" in c else ""
        margin = f", margin {c['margin']:.4f}" if "margin" in c else ""
        why = f" ({c['why']})" if "why" in c else ""
        same = lambda ok: "equal" if ok else "not equal"  # noqa: E731
        equal = (f"; FLOPs x{c['flops_ratio']:.2f} ({same(c['equal_flops'])}), params x{c['params_ratio']:.2f} "
                 f"({same(c['equal_params'])})") if "flops_ratio" in c else ""
        if "prediction" in c:
            head = f"- prediction: {c['prediction']} [{c['metric'] if 'metric' in c else 'accuracy'}]"
            status = f" -> {'holds' if c['holds'] else 'does not hold'}"
            accs = "" if "acc_table" not in c else (f" table {100 * c['acc_table']:.0f}%, "
                                                    f"context {100 * c['acc_context']:.0f}%")
            out.append(f"{head}:{accs} {gain}{margin}{why}{status}")
        else:
            out.append(f"- {ref} vs {c['model']} [bits/byte]: {gain}{margin}{why} -> {c['verdict']}{equal}")
    return out if len(out) > 2 else out + ["- no comparison yet: the reference has no finished run"]
