"""The import structure of the two packages, read from their source (``ast``; every import statement, those
inside functions too): no import cycle but the registry's deliberate one, no module importing a layer above
its own, no private name imported from another module. ``allhere`` is the library; ``allhere_recipes``
(demo, sweep, studies, bench, cost models) sits on top of it, and only the command line imports it."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("allhere", "allhere_recipes")

# The layers, bottom first (the data flow of the design guide: config -> registry -> mechanism -> op, and
# model -> train -> recipes -> cli, with the hosts hf/ and serve/ above the mechanisms). A module may
# import modules of its own layer and of the layers below it. A module belongs to the entry with the longest
# matching prefix; ``allhere`` alone is the package's public face (it gathers names up to the model). The
# kernels are the ground floor of the ops: they import nothing of ops/, mechanisms/ or serve/ (what they share
# with the ops, such as the softmax merges of ``allhere.softmax``, lies below them). The run utilities of
# ``allhere.runtime`` (run lock, stop signals, progress) are foundation, all but the checkpoints, which hold a model,
# the training reports, which draw a model's routing, and the cache of fetched models, where they stood before.
LAYERS = [
    ("foundation", ["allhere.validation", "allhere._optional", "allhere._deprecated", "allhere.backend",
                    "allhere.hosts", "allhere.runtime", "allhere.masks", "allhere.softmax", "allhere.distributed.env",
                    "allhere.distributed.layouts"]),
    ("kernel", ["allhere.kernels"]),
    ("op", ["allhere.ops", "allhere.distributed.ring", "allhere.distributed.ring_blocks",
            "allhere.distributed.ring_plan", "allhere.distributed.ring_far"]),
    ("mechanism", ["allhere.registry", "allhere.mechanisms"]),
    ("config", ["allhere.config", "allhere.distributed.parallel"]),
    ("model", ["allhere", "allhere.model", "allhere.routing", "allhere.losses", "allhere.runtime.model_checkpoint",
               "allhere.checkpoint", "allhere.data", "allhere.analysis", "allhere.teaching"]),
    ("train", ["allhere.train", "allhere.runtime.reporting", "allhere.reporting", "allhere.distributed"]),
    ("host", ["allhere.hf", "allhere.serve", "allhere.runtime.models_cache", "allhere.models_cache"]),
    ("application", ["allhere.eval", "allhere.generation"]),
    ("recipes", ["allhere_recipes"]),
    ("cli", ["allhere.cli"]),
]

# The one cycle on purpose: the registry imports the built-in mechanisms (``registry._builtins``) so that
# ``registry.kinds()`` knows them, and each mechanism module imports the registry to register itself.
DELIBERATE = {("allhere.registry", "allhere.mechanisms")}


def modules() -> dict[str, Path]:
    found = {}
    for path in (p for package in PACKAGES for p in (ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = modules()


def imports(name: str) -> list[tuple[str, str]]:
    """(module imported, name taken from it or "") of every import of the two packages' modules in ``name``."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, "") for a in node.names if a.name.split(".")[0] in PACKAGES]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] not in PACKAGES:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append((sub, "") if sub in MODULES else (base, alias.name))
    return out


def graph() -> dict[str, set[str]]:
    return {m: {t for t, _ in imports(m) if t in MODULES and t != m} for m in MODULES}


def layer(name: str) -> int:
    best, found = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or (p != "allhere" and name.startswith(p + "."))) and len(p) > best:
                best, found = len(p), i
    assert found is not None, f"{name} is in no layer of LAYERS: add it"
    return found


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_layer():
    for name in MODULES:
        layer(name)


def test_the_deliberate_cycle_is_there():
    edges = graph()
    assert all(b in edges[a] for a, b in DELIBERATE), "the registry no longer imports the mechanisms: update DELIBERATE"
    assert cycles(edges), "no cycle left at all: remove DELIBERATE"


def test_no_import_cycle_but_the_registry():
    edges = graph()
    for a, b in DELIBERATE:
        edges[a].discard(b)
    assert cycles(edges) == []


def test_no_module_imports_a_layer_above_its_own():
    up = [f"{m} ({LAYERS[layer(m)][0]}) imports {t} ({LAYERS[layer(t)][0]})"
          for m, targets in graph().items() for t in sorted(targets)
          if layer(t) > layer(m) and (m, t) not in DELIBERATE]
    assert up == []


def test_the_kernels_import_no_op_mechanism_or_host():
    """The ground-floor rule by name (the layers above enforce it too): ``allhere.kernels`` imports nothing of
    ``allhere.ops``, ``allhere.mechanisms`` or ``allhere.serve``."""
    up = [f"{m} imports {t}" for m, targets in graph().items() if m.startswith("allhere.kernels")
          for t in sorted(targets) if t.split(".")[:2] in (["allhere", "ops"], ["allhere", "mechanisms"],
                                                           ["allhere", "serve"])]
    assert up == []


def test_only_the_command_line_imports_the_recipes():
    importers = sorted(m for m, targets in graph().items() for t in targets
                       if t.split(".")[0] == "allhere_recipes" and m.split(".")[0] == "allhere"
                       and not m.startswith("allhere.cli"))
    assert importers == []


def test_no_private_name_imported_from_another_module():
    private = [f"{m}: from {base} import {name}" for m in MODULES for base, name in imports(m)
               if name.startswith("_") and not name.startswith("__")]
    assert private == []


@pytest.mark.parametrize("name", ["allhere.ops.aha.dispatch", "allhere.hf", "allhere_recipes.ops_bench"])
def test_the_parser_sees_relative_and_lazy_imports(name):
    """The checks above rest on ``imports``: it resolves relative imports and sees those inside functions."""
    found = {t for t, _ in imports(name)}
    assert found and all(t.split(".")[0] in PACKAGES for t in found)
    if name == "allhere_recipes.ops_bench":
        assert "allhere_recipes.bench_profile" in found  # imported inside run_bench


def test_import_allhere_leaves_the_serving_code_alone():
    """Every mechanism declares how vLLM serves it (``registry.Serving``, plain data) without the serving code:
    ``import allhere`` and reading every registered kind's spec import neither vLLM nor ``allhere.serve``."""
    code = ("import sys, allhere; from allhere import registry; [registry.get(k).serving for k in registry.kinds()]; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm' or m.startswith('allhere.serve')))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]"


def test_import_allhere_loads_no_run_utility():
    """``import allhere`` gathers the model's names; the run utilities (``allhere.runtime``: checkpoints, run lock,
    stop signals, progress, training reports, the models' cache) load where a command uses them, and their old paths
    only where they are asked for."""
    code = ("import sys, allhere; print(sorted(m for m in sys.modules if m.startswith(('allhere.runtime', "
            "'allhere.checkpoint', 'allhere.train', 'allhere.reporting', 'allhere.models_cache'))))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]"
