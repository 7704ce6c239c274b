"""The source's layering, read from its imports (top-level ones and those inside functions alike): no
module imports one of a higher layer, and no modules import each other in a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src" / "strata"
#: each top-level module or package of strata, by layer: a module imports only from its own layer or below
LAYERS = [
    {"__init__", "errors", "files", "gguf_names", "gguf_file", "gguf_vocab", "tokenizer", "prompts", "demo"},
    {"layers"},
    {"cache", "models"},
    {"engine"},
    {"dflash"},
    {"checks", "pair"},
    {"bench", "serve"},
    {"cli", "cli_options", "__main__"},
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict) -> set[str]:
    """The strata modules `name` imports, wherever in it the import stands."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == "strata":
                base = node.module.split(".")[1:]
            else:
                continue
            for alias in node.names:
                full = ".".join(base + [alias.name])
                out.add(full if full in known else ".".join(base) or "__init__")
        elif isinstance(node, ast.Import):
            out |= {a.name.removeprefix("strata.") for a in node.names if a.name.split(".")[0] == "strata"}
    return {m for m in out if m in known and m != name}


def test_no_module_imports_a_higher_layer_and_none_import_in_a_cycle():
    known = modules()
    assert set(RANK) >= {m.split(".")[0] for m in known}, "a new top-level module needs its layer here"
    graph = {name: imports(name, path, known) for name, path in known.items()}
    upward = [f"{m} -> {d}" for m, ds in graph.items() for d in ds if RANK[d.split(".")[0]] > RANK[m.split(".")[0]]]
    assert not upward, upward
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m, path):
        state[m] = 1
        for d in graph[m]:
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(d):] + [d]))
            if d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [m])
