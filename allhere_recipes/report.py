"""The one report writer of the experiments (``<name>.md`` and ``<name>.json``, written atomically) and
the formatting their markdown shares."""

from __future__ import annotations

from pathlib import Path

from .rundir import write_json, write_text


def write_report(folder: str | Path, name: str, report: dict, markdown: str) -> dict[str, Path]:
    """Write ``report`` to ``folder/name.json`` and ``markdown`` to ``folder/name.md``; return both paths."""
    folder = Path(folder)
    paths = {"json": folder / f"{name}.json", "md": folder / f"{name}.md"}
    write_json(paths["json"], report)
    write_text(paths["md"], markdown)
    return paths


def percent(x: float) -> str:
    """A share (0..1) as a percentage with one decimal: 0.123 -> "12.3%"."""
    return f"{100 * x:.1f}%"


def goal_lines(goals: dict[str, bool]) -> list[str]:
    """A markdown checklist: one "- [x] goal" (met) or "- [ ] goal" (missed) line per goal."""
    return [f"- [{'x' if ok else ' '}] {goal}" for goal, ok in goals.items()]
