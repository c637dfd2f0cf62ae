"""The demo's report: report.json (everything), report.md (tables and goals), mu_f_heatmap.png."""

from __future__ import annotations

import json
from pathlib import Path

from ..checkpoint import atomic_write


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def lm_table(res: dict) -> list[str]:
    lines = ["| model | held-out bits/byte | Retain % | mu_f |", "|---|---|---|---|"]
    for name, r in res["rows"].items():
        lines.append(f"| {name} | {r['bits_per_token']:.4f} | {r['retain_percent']:.1f}% | {_pct(r['mu_f'])} |")
    return lines


def recall_table(res: dict) -> list[str]:
    lines = ["| model | accuracy | mu_f retrieval tokens | mu_f other tokens | mu_f all |", "|---|---|---|---|---|"]
    for name, r in res["rows"].items():
        lines.append(f"| {name} | {_pct(r['accuracy'])} | {_pct(r['mu_f_retrieval'])} | {_pct(r['mu_f_other'])} "
                     f"| {_pct(r['mu_f'])} |")
    chance = next(iter(res["rows"].values()))["chance"]
    lines.append(f"\nChance accuracy: {_pct(chance)}.")
    return lines


def render_markdown(report: dict) -> str:
    out = ["# allhere demo report", "",
           f"Preset `{report['preset']}` on `{report['device']}`, torch {report['torch']}, "
           f"{report['seconds']:.0f} s in all.", ""]
    for name, res in report["tasks"].items():
        out += [f"## {name}", "", f"Data: {res['data']}", ""]
        out += lm_table(res) if name == "stdlib" else recall_table(res)
        aha = next((r for r in res["rows"].values() if "retain_vs_control_percent" in r), None)
        if aha is not None:
            out += ["", f"Against the control trained for as many steps, AHA keeps "
                        f"{aha['retain_vs_control_percent']:.1f}% (loss ratio)."]
        out += ["", "Goals:"]
        out += [f"- [{'x' if ok else ' '}] {goal}" for goal, ok in res["goals"].items()]
        out.append("")
    out.append("Retain % = held-out loss of the pretrained full model / loss of the row (higher is better); "
               "mu_f = share of (token, head) pairs on full attention (seeds/003 Eq. 8).")
    return "\n".join(out) + "\n"


def write_report(report: dict, out: str | Path) -> dict[str, Path]:
    out = Path(out)
    paths = {"json": out / "report.json", "md": out / "report.md"}
    atomic_write(paths["json"], lambda tmp: tmp.write_text(json.dumps(report, indent=1) + "\n"))
    atomic_write(paths["md"], lambda tmp: tmp.write_text(render_markdown(report)))
    panels, layers = {}, {}
    for name, res in report["tasks"].items():
        for row_name, r in res["rows"].items():
            if "usage" in r:
                title = f"{name}: {row_name}"
                panels[title], layers[title] = r["usage"], res["aha_layers"]
    if panels:
        from .plots import usage_heatmaps

        paths["png"] = usage_heatmaps(panels, out / "mu_f_heatmap.png", layers)
    return paths
