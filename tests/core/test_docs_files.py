"""The docs name the files that are there: the package layout of docs/mechanisms.md has a line for every module of
``allhere`` and ``allhere_recipes`` and names nothing that is gone, and every file a page of the docs names
exists. A module added, renamed or moved without its line in the map fails here, with the names to fix."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAP = ROOT / "docs" / "mechanisms.md"
MAPPED = ("allhere", "allhere_recipes")  # packages whose every module has its line in the map
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # docs/gpu-runs/ holds past runs' logs, as run
TOP = ("allhere", "allhere_recipes", "benchmarks", "docs", "scripts", "tests")  # a path from the root starts so

# A file or folder name in the map: a bare token ending in .py, .sh or "/", after a space, "(" or "," and before a
# space, ",", ";", ":", ")" or the end of the line (so that `allhere generate` or a dotted name is never one).
MAP_NAME = re.compile(r"(?<![^\s(,])([\w-]+(?:/[\w-]+)*(?:\.py|\.sh|/))(?=[\s,;:)]|$)")
ROOTED = re.compile(rf"(?<![\w./-])((?:{'|'.join(TOP)})/[\w./-]*[\w/])")  # a path from the root anywhere in a page
TICKED_FILE = re.compile(r"`([\w./-]+\.(?:py|sh))`")  # a file named in backticks, maybe by its last parts only


def layout_entries() -> list[tuple[str, list[str]]]:
    """(path from the root, [names relative to its folder]) for each entry of the package layout: an entry starts
    at the left edge with its path, and its lines go on indented."""
    section = MAP.read_text().split("## Package layout", 1)[1]
    block = section.split("```", 2)[1]
    entries: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            head, _, rest = line.partition(" ")
            entries.append((head.rstrip(","), []))
            line = rest
        assert entries, f"the package layout starts with an indented line: {line!r}"
        entries[-1][1].extend(MAP_NAME.findall(line))
    return entries


def mapped_paths() -> set[str]:
    """Every path the layout names, from the root ("allhere/ops/" for a folder)."""
    out = set()
    for head, names in layout_entries():
        folder = head if head.endswith("/") else head.rpartition("/")[0] + "/"
        out.add(head)
        out.update(folder + name for name in names)
    return out


def test_the_layout_is_read():
    entries = dict(layout_entries())
    assert "allhere/mechanisms/" in entries and "aha.py" in entries["allhere/mechanisms/"]
    assert "allhere/__init__.py" in entries and "allhere_recipes/" in entries


def test_every_path_the_layout_names_exists():
    missing = sorted(p for p in mapped_paths() if not (ROOT / p).exists() or p.endswith("/") != (ROOT / p).is_dir())
    assert missing == [], "docs/mechanisms.md's package layout names what is not there: " + ", ".join(missing)


def test_every_module_has_its_line_in_the_layout():
    """Every module of the mapped packages is named; a package's ``__init__.py`` is covered by its folder's name."""
    named = mapped_paths()
    unnamed = []
    for package in MAPPED:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            folder = path.parent.relative_to(ROOT).as_posix() + "/"
            if rel not in named and not (path.name == "__init__.py" and folder in named):
                unnamed.append(rel)
    assert unnamed == [], "add these modules to docs/mechanisms.md's package layout: " + ", ".join(unnamed)


def test_every_file_the_docs_name_exists():
    """A path from the root (``allhere/...``, ``tests/...``, ...) names a file or folder that is there; a file in
    backticks named by its last parts (``aha/fast.py``) is the end of some file's path."""
    files = [p.relative_to(ROOT).as_posix() for top in TOP for p in (ROOT / top).rglob("*") if p.is_file()]
    missing = []
    for doc in DOCS:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            for path in ROOTED.findall(line):
                if "*" not in path and not (ROOT / path).exists():
                    missing.append(f"{doc.name}:{number}: {path}")
            for name in TICKED_FILE.findall(line):
                if name.split("/")[0] not in TOP and not any(f == name or f.endswith("/" + name) for f in files):
                    missing.append(f"{doc.name}:{number}: {name}")
    assert missing == [], "the docs name files that are not there: " + "; ".join(missing)
