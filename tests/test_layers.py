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
                if module.split(".")[0] in ("tests", "bench") or module.startswith("noderag_cli"):
                    forbidden.append(f"{path.relative_to(ROOT)}:{line} {module}")
            elif name in layer and layer[name] < layer[top]:
                upward.append(f"{path.relative_to(ROOT)}:{line} {top} -> {name}")
    assert upward == [], "imports up the layers"
    assert forbidden == [], "the package imports the tests, the benchmarks or itself by absolute name"


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
