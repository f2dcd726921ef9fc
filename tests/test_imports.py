"""The imports among data_prep's modules, and among pipeline's, go one way (ARCHITECTURE.md
"Layers"): no cycle, counting imports inside functions and under `TYPE_CHECKING` too, so none can
be dodged by importing late."""
from __future__ import annotations

import ast
from pathlib import Path

DATA_PREP = Path(__file__).resolve().parents[1] / "data_prep"
PIPELINE = Path(__file__).resolve().parents[1] / "pipeline"


def _import_graph(folder: Path) -> dict[str, set[str]]:
    """{module: the package's modules it imports}, for every `*.py` of the package `folder`,
    from every import statement in it (module level, inside functions, classes or `if`s).
    Names are dotted (`data_prep.cli`); `from data_prep import cli` counts as importing
    `data_prep.cli` when `cli.py` is in the folder; relative imports are resolved."""
    package = folder.name
    modules = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for path in sorted(folder.glob("*.py")):
        if path.stem == "__init__":
            continue
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package if node.level else (node.module or "")
                if node.level and node.module:
                    base = f"{package}.{node.module}"
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                parts = t.split(".")
                if len(parts) >= 2 and parts[0] == package and parts[1] in modules:
                    edges.add(f"{package}.{parts[1]}")
        edges.discard(f"{package}.{path.stem}")
        graph[f"{package}.{path.stem}"] = edges
    return graph


def _tree_graph(folder: Path) -> dict[str, set[str]]:
    """`_import_graph` over a package with subpackages: {module: modules of the tree it imports}
    (dotted names such as `pipeline.model.qwen3`; `__init__` files are not nodes, so importing a
    package's re-export counts only when it names a module: `from pipeline.model import qwen3`)."""
    top = folder.parent
    modules = {".".join(p.relative_to(top).with_suffix("").parts): p
               for p in sorted(folder.rglob("*.py")) if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(name.split(".")[:-node.level] + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            edges.update(t for t in targets if t in modules)
        edges.discard(name)
        graph[name] = edges
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as `[a, b, ..., a]`, or None when it has none (depth-first
    search; a node met again while still on the path closes a cycle)."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            found = visit(nxt)
            if found:
                return found
        path.pop()
        done.add(node)
        return None

    for start in sorted(graph):
        found = visit(start)
        if found:
            return found
    return None


def test_data_prep_imports_have_no_cycle():
    graph = _import_graph(DATA_PREP)
    assert {"data_prep.shard", "data_prep.cli", "data_prep.prepare", "data_prep.plan",
            "data_prep.merge", "data_prep.units"} <= set(graph)
    cycle = _cycle(graph)
    assert cycle is None, "data_prep import cycle: " + " -> ".join(cycle)


def test_pipeline_imports_have_no_cycle():
    graph = _tree_graph(PIPELINE)
    assert {"pipeline.train", "pipeline.model.qwen3", "pipeline.model.kv_cache",
            "pipeline.checkpoint.store", "pipeline.checkpoint.safe_load"} <= set(graph)
    assert "pipeline.checkpoint.errors" in graph["pipeline.checkpoint.safe_load"]
    cycle = _cycle(graph)
    assert cycle is None, "pipeline import cycle: " + " -> ".join(cycle)


def test_shard_py_is_only_the_entry_point():
    """`python data_prep/shard.py` imports the command line and nothing else of data_prep;
    the library below it imports no stage module."""
    graph = _import_graph(DATA_PREP)
    assert graph["data_prep.shard"] == {"data_prep.cli"}
    assert graph["data_prep.cli"] >= {"data_prep.plan", "data_prep.merge", "data_prep.prepare"}
    assert not graph["data_prep.prepare"] & {"data_prep.shard", "data_prep.cli",
                                             "data_prep.plan", "data_prep.merge"}


def test_a_cycle_through_a_late_import_is_found(tmp_path):
    """The check sees an import inside a function, a `from pkg import mod` and a relative
    import, and names the cycle; the same files without the late import have none."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("from .c import f\n")
    (pkg / "c.py").write_text("import os\n\ndef f():\n    if os:\n        import pkg.a.x\n")
    graph = _import_graph(pkg)
    assert graph == {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": {"pkg.a"}}
    assert _cycle(graph) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    (pkg / "c.py").write_text("import os\n\ndef f():\n    return os\n")
    assert _cycle(_import_graph(pkg)) is None
    # the same in a subpackage, through a TYPE_CHECKING import and a relative one
    sub = pkg / "sub"
    sub.mkdir()
    (sub / "__init__.py").write_text("")
    (sub / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from pkg.sub.e import E\n")
    (sub / "e.py").write_text("from . import d\n")
    graph = _tree_graph(pkg)
    assert graph["pkg.sub.d"] == {"pkg.sub.e"} and graph["pkg.sub.e"] == {"pkg.sub.d"}
    assert _cycle(graph) == ["pkg.sub.d", "pkg.sub.e", "pkg.sub.d"]
