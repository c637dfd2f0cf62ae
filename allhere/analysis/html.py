"""A token-level HTML page (Fig. 1 of the AHA paper): each token coloured by how many heads went global on it."""

from __future__ import annotations

import html
from pathlib import Path

from ..runtime.model_checkpoint import atomic_write

_STYLE = """body{font-family:sans-serif;margin:24px;max-width:1100px}
.text{font-family:monospace;white-space:pre-wrap;line-height:1.7;border:1px solid #ccc;padding:12px}
.legend{display:flex;align-items:center;gap:8px;margin:12px 0}
.bar{width:260px;height:14px;background:linear-gradient(to right,rgb(255,255,255),rgb(8,48,107));border:1px solid #999}
span.t{border-radius:2px}"""


def _colour(frac: float) -> str:
    """White (no head global) to dark blue (every head global)."""
    r, g, b = (round(255 + (c - 255) * frac) for c in (8, 48, 107))
    return f"rgb({r},{g},{b})"


def token_page(tokens: list[str], global_heads: list[int], total_heads: int, title: str, path: str | Path,
               note: str = "") -> Path:
    """tokens: display strings; global_heads[i]: (layer, head) pairs on full attention at token i."""
    if len(tokens) != len(global_heads):
        raise ValueError("one count per token is needed")
    spans = []
    for tok, n in zip(tokens, global_heads):
        frac = n / total_heads if total_heads else 0.0
        fg = "white" if frac > 0.5 else "black"
        spans.append(f'<span class="t" style="background:{_colour(frac)};color:{fg}" '
                     f'title="{n}/{total_heads} heads global">{html.escape(tok)}</span>')
    page = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body><h2>{html.escape(title)}</h2><p>{html.escape(note)}</p>"
            f"<div class='legend'><span>0 of {total_heads} heads global</span><div class='bar'></div>"
            f"<span>all {total_heads} heads global</span></div><div class='text'>{''.join(spans)}</div>"
            "</body></html>\n")
    path = Path(path)
    atomic_write(path, lambda tmp: tmp.write_text(page, encoding="utf-8"))
    return path


def byte_tokens(ids: list[int]) -> list[str]:
    """Display strings for byte tokens: printable ASCII as is, newline and tab kept, others as a dot."""
    return [chr(i) if 32 <= i < 127 or i in (9, 10) else "\u00b7" for i in ids]
