"""How deep serving's imports go: from any module of ``allhere.serve`` or ``allhere.ops.paged``, the longest chain of
allhere modules each importing the next when it is loaded (an import at module level, not one inside a function) is
at most ``MOST`` imports long. A chain that grows past it means a module on serving's path imports through a package
that re-exports everything, or loads at import what it needs only when called; the failure prints the chain."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "allhere"
STARTS = ("allhere.serve", "allhere.ops.paged")  # the modules whose chains are measured, and those below them
MOST = 8  # imports in a chain


def modules() -> dict[str, Path]:
    found = {}
    for path in (ROOT / PACKAGE).rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = modules()


def loaded_with(name: str) -> set[str]:
    """The allhere modules that ``name``'s import statements load when ``name`` is loaded: those at module level,
    in an ``if``, ``try`` or ``with`` there and in class bodies (not in functions, nor under ``TYPE_CHECKING``).
    ``from package import x`` is an import of module ``package.x`` where there is one, else of ``package`` (its
    ``__init__``); relative imports are resolved."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(body) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = alias.name
                    while target and target not in MODULES:
                        target = target.rpartition(".")[0]
                    if target:
                        found.add(target)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                if base.split(".")[0] != PACKAGE:
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    found.add(sub if sub in MODULES else base)
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                for part in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                    visit(part)
            elif isinstance(node, (ast.With, ast.ClassDef)):
                visit(node.body)

    visit(ast.parse(path.read_text()).body)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: loaded_with(name) for name in MODULES}


def deepest(name: str, known: dict | None = None, loading: tuple = ()) -> tuple[str, ...]:
    """The longest chain of imports from ``name``: (name, a module it imports, one that module imports, ...)."""
    known = {} if known is None else known
    if name not in known:
        loading = (*loading, name)
        longest = (name,)
        for target in sorted(GRAPH[name]):
            assert target not in loading, "a cycle at module level: " + " -> ".join((*loading, target))
            chain = (name, *deepest(target, known, loading))
            if len(chain) > len(longest):
                longest = chain
        known[name] = longest
    return known[name]


def serving_chains() -> list[tuple[str, ...]]:
    known: dict = {}
    return sorted((deepest(m, known) for m in MODULES if m.startswith(STARTS)), key=len, reverse=True)


def test_serving_imports_are_at_most_eight_deep():
    chain = serving_chains()[0]
    assert len(chain) - 1 <= MOST, (f"{chain[0]} imports {len(chain) - 1} modules deep (at most {MOST}):\n  "
                                    + "\n  -> ".join(chain))


def test_the_chains_are_read():
    """The measure sees serving's imports: the vLLM glue reaches the paged op and the masks below it."""
    deep = {m for chain in serving_chains() for m in chain}
    assert {"allhere.serve.vllm.attention", "allhere.ops.paged.attention", "allhere.masks.mask"} <= deep
    assert "allhere.ops.paged.attention" in GRAPH["allhere.serve.vllm.attention"]
