"""The package's imports against the layers written down in docs/architecture.md: a module may
import its own layer or a lower one, never a higher one, and never the tests or the benchmarks.
Read from the document, so the picture and the code cannot drift apart."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "noderag_cli"


def layers() -> dict[str, int]:
    """Top-level module or sub-package -> its layer (0 = the top), from the document's first code block."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = text.split("## Layers", 1)[1].split("```", 2)[1]
    found = {}
    for depth, line in enumerate(line for line in block.splitlines() if line.strip()):
        names = re.split(r"\s{3,}", line.strip())[0].split()
        found.update({name.rstrip("/"): depth for name in names})
    return found


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, top-level name within the package) of every import in the file, inside functions too;
    absolute imports outside the package as (line, "<absolute> name")."""
    inside = path.relative_to(PACKAGE).parts[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(inside[: len(inside) - (node.level - 1)])
            target = base + (node.module.split(".") if node.module else [])
            names = [target[0]] if target else [alias.name for alias in node.names]
            found += [(node.lineno, name) for name in names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.lineno, f"<absolute> {node.module}"))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, f"<absolute> {alias.name}") for alias in node.names]
    return found


def test_every_module_has_a_layer_and_imports_only_downwards():
    layer = layers()
    modules = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
               if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and (p / "__init__.py").is_file())}
    assert modules - set(layer) == set(), "modules without a layer in docs/architecture.md"
    upward, forbidden = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        top = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        if top == "__init__":
            continue
        for line, name in imports(path):
            if name.startswith("<absolute> "):
                module = name.split()[1]
                if module.split(".")[0] in ("tests", "bench", "devtools") or module.startswith("noderag_cli"):
                    forbidden.append(f"{path.relative_to(ROOT)}:{line} {module}")
            elif name in layer and layer[name] < layer[top]:
                upward.append(f"{path.relative_to(ROOT)}:{line} {top} -> {name}")
    assert upward == [], "imports up the layers"
    assert forbidden == [], "the package imports the tests, the benchmarks, devtools or itself by absolute name"


def test_the_layer_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The check itself: an import of the CLI from the store is caught."""
    fake = tmp_path / "noderag_cli"
    fake.mkdir()
    (fake / "workspace.py").write_text("def f():\n    from .cli import app\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    found = imports(fake / "workspace.py")
    assert found == [(2, "cli")] and layers()["cli"] < layers()["workspace"]


def version_constants(package: Path) -> list[str]:
    """`module.NAME` of every module-level constant whose name holds VERSION (dotted from the package,
    `readers` for `readers/__init__.py`)."""
    found = []
    for path in sorted(package.rglob("*.py")):
        module = ".".join(path.relative_to(package).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
            found += [f"{module}.{t.id}" for t in targets if isinstance(t, ast.Name) and "VERSION" in t.id]
    return found


def test_every_version_constant_is_listed_with_what_bumping_it_redoes():
    """A version constant decides whether stored work is reused; docs/architecture.md says, for each,
    what bumping it re-runs. A new one must be added there."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = text.split("## Versions", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `([\w./]+)`", table, flags=re.MULTILINE))
    constants = version_constants(PACKAGE)
    assert len(constants) >= 10
    missing = [c for c in constants if c.replace(".", "/", c.count(".") - 1) not in listed]
    assert missing == [], "version constants docs/architecture.md does not list (section Versions)"


def test_the_version_check_sees_a_new_constant(tmp_path):
    (tmp_path / "index").mkdir()
    (tmp_path / "index" / "new_stage.py").write_text("LISTS_VERSION = 2\nother = 1\n")
    assert version_constants(tmp_path) == ["index.new_stage.LISTS_VERSION"]


def module_imports(package: Path) -> dict[str, set[str]]:
    """Dotted module -> the package's modules it imports, inside functions too (a lazy import is
    still a dependency: it only hides a cycle until the call)."""
    def name(path: Path) -> str:
        parts = path.relative_to(package).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    modules = {name(p): p for p in package.rglob("*.py")}
    found: dict[str, set[str]] = {}
    for module, path in modules.items():
        here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level:
                target = here[: len(here) - (node.level - 1)] + (node.module.split(".") if node.module else [])
                for alias in node.names:  # `from . import x` and `from .pkg import x` may name a module
                    as_module = ".".join([*target, alias.name])
                    deps.add(as_module if as_module in modules else ".".join(target))
        found[module] = {d for d in deps if d in modules and d != module}
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack, on_stack, groups = [], set(), []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return groups


def test_no_import_cycles_within_the_package():
    """Imports run downwards between layers (above); within a layer, no two modules may import
    each other, directly or around a loop, lazily or not."""
    assert cycles(module_imports(PACKAGE)) == []


def test_the_cycle_check_sees_a_lazy_cycle(tmp_path):
    (tmp_path / "engines").mkdir()
    (tmp_path / "engines" / "__init__.py").write_text("")
    (tmp_path / "engines" / "a.py").write_text("from .b import f\n")
    (tmp_path / "engines" / "b.py").write_text("def f():\n    from . import c\n")
    (tmp_path / "engines" / "c.py").write_text("def g():\n    from .a import f\n")
    (tmp_path / "other.py").write_text("from .engines import a\n")
    assert cycles(module_imports(tmp_path)) == [["engines.a", "engines.b", "engines.c"]]


def engine_name_checks(root: Path) -> list[str]:
    """`file:line` of every comparison with a config's engine name (`llm.engine == ...`) outside
    engines/: what an engine can do is its declared capabilities (`asks_a_model`, `cites_context`,
    ... on `engines.base.Engine`), so a new engine changes one package, not every caller."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if "engines" in path.relative_to(root).parts[:-1]:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare) and any(
                    isinstance(side, ast.Attribute) and side.attr == "engine" and isinstance(side.value, ast.Attribute)
                    and side.value.attr == "llm" for side in (node.left, *node.comparators)):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_no_module_outside_engines_decides_by_the_engine_name():
    assert engine_name_checks(PACKAGE) == []


def test_the_engine_name_check_sees_a_comparison(tmp_path):
    (tmp_path / "search").mkdir()
    (tmp_path / "search" / "x.py").write_text("def f(config):\n    return config.llm.engine != 'offline'\n")
    (tmp_path / "engines").mkdir()
    (tmp_path / "engines" / "y.py").write_text("def g(config):\n    return config.llm.engine == 'litellm'\n")
    assert engine_name_checks(tmp_path) == ["search/x.py:2"]


def test_the_cache_namespaces_are_declared_once_and_the_docs_list_them():
    """Every namespace a module stores under is a constant of `cache.NAMESPACES` (no bare string
    in a cache call), and docs/workspace.md names exactly those."""
    from noderag_cli.cache import NAMESPACES

    calls = re.compile(r"\.(?:get_many|put_many|touch|delete_many)\(\s*[\"']")
    bare = [f"{p.relative_to(PACKAGE)}" for p in sorted(PACKAGE.rglob("*.py")) if calls.search(p.read_text(encoding="utf-8"))]
    assert bare == [], "cache calls with a namespace written as a string"
    row = next(line for line in (ROOT / "docs" / "workspace.md").read_text(encoding="utf-8").splitlines()
               if line.startswith("| `cache.sqlite` |"))
    assert set(re.findall(r"`(\w+)` \(", row)) == set(NAMESPACES)
