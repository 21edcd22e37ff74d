"""The package's layout: imports run one way, and no module imports itself in a circle.

The layers, in the order an update flows: ``codec`` <- ``encoding`` <- ``local``,
``distributed`` <- ``integrations``, ``app`` (each subpackage's docstring says what it may
import). The check reads every module's imports with ``ast`` (nothing is imported, so no import
side effect can hide or cause a fault) and counts every import, function-level ones included:
a lazy import still couples the modules.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"

BASE, TOP = "base", "top"
"""Root-private modules (``gradshare._checks``, ``gradshare._moved``), and the package's own
``__init__``, which gathers the public names."""

MAY_IMPORT: dict[str, set[str]] = {
    BASE: set(),
    "codec": {BASE},
    "encoding": {"codec", BASE},
    "local": {"encoding", "codec", BASE},
    "distributed": {"encoding", "codec", BASE},
    "integrations": {"distributed", "local", "encoding", "codec", BASE, TOP},
    "app": {"distributed", "local", "encoding", "codec", BASE, TOP},
    TOP: {"distributed", "local", "encoding", "codec", BASE},
}
"""Layer -> the layers its modules may import (its own layer always)."""


def modules(src: Path) -> dict[str, Path]:
    """Every module of the ``gradshare`` package under ``src``: dotted name -> file."""
    out = {}
    for path in sorted((src / "gradshare").rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return TOP
    if len(parts) == 2 and parts[1].startswith("_") and parts[1] != "__main__":
        return BASE
    return parts[1]


def imports(module: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """(imported gradshare module, line) for every import in ``path``: ``from P import n``
    names module ``P.n`` where that is a module, else ``P``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "gradshare":
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if base.split(".")[0] != "gradshare":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield (sub if sub in known else base), node.lineno


def violations(src: Path) -> list[str]:
    """Every import that runs against the layers, and every import circle, as text."""
    known = modules(src)
    found, graph = [], {}
    for module, path in known.items():
        graph[module] = set()
        if layer(module) not in MAY_IMPORT:
            found.append(f"{path.relative_to(src)}: {module} is in none of {sorted(MAY_IMPORT)}")
            continue
        for target, line in imports(module, path, known):
            if target == module:
                continue
            graph[module].add(target)
            mine, theirs = layer(module), layer(target)
            if theirs != mine and theirs not in MAY_IMPORT[mine]:
                found.append(
                    f"{path.relative_to(src)}:{line}: {module} ({mine}) imports {target} "
                    f"({theirs}); {mine} may import {sorted(MAY_IMPORT[mine])}"
                )
            owner = _private_owner(target)
            if owner is not None and not (module + ".").startswith(owner + "."):
                found.append(
                    f"{path.relative_to(src)}:{line}: {module} imports {target}, a private "
                    f"module of {owner}: import what {owner} makes public"
                )
    found += [f"import circle: {' -> '.join(c)}" for c in circles(graph)]
    return found


def _private_owner(module: str) -> str | None:
    """The package whose private module ``module`` is (``gradshare.codec`` for
    ``gradshare.codec._flat``), or None for a public one (root-private modules, which every
    layer may import, are the base layer's, not private)."""
    parts = module.split(".")
    for i in range(2, len(parts)):
        if parts[i].startswith("_"):
            return ".".join(parts[:i])
    return None


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each strongly connected group of modules (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append([*sorted(group), sorted(group)[0]])

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_imports_run_one_way_and_in_no_circle() -> None:
    assert violations(SRC) == []


MODULE_LINES = 600
"""The most lines of a module outside ``codec/`` (whose kernels are long by nature)."""
CLASS_LINES = {"gradshare.distributed.local_steps.core": ("LocalSteps", 300)}
"""Classes that wire parts together and must stay short: module -> (class, most lines)."""


def test_modules_and_wiring_classes_stay_small() -> None:
    """A module outside ``codec/`` of at most 600 lines; LocalSteps, which wires its package's
    parts, of at most 300 (it was 900 lines of one 1,152-line module, seven concerns)."""
    known = modules(SRC)
    lines = {m: len(p.read_text().splitlines()) for m, p in known.items() if layer(m) != "codec"}
    long = {m: n for m, n in lines.items() if n > MODULE_LINES}
    assert long == {}
    for module, (name, most) in CLASS_LINES.items():
        tree = ast.parse(known[module].read_text())
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
        assert cls.end_lineno is not None
        assert cls.end_lineno - cls.lineno + 1 <= most, (name, cls.end_lineno - cls.lineno + 1)


def test_every_subpackage_says_what_lives_there_and_what_it_may_import() -> None:
    for init in sorted((SRC / "gradshare").glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "May import" in doc or "may import" in doc, init


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / "gradshare" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    ("files", "expect"),
    [
        (  # the codec reaching up into the exchange
            {
                "codec/__init__.py": "",
                "codec/threads.py": "from gradshare.distributed import x\n",
                "distributed/__init__.py": "",
                "distributed/x.py": "",
            },
            "gradshare.codec.threads (codec) imports gradshare.distributed.x (distributed)",
        ),
        (  # a lazy import counts too
            {
                "encoding/__init__.py": "",
                "encoding/e.py": "def f():\n    import gradshare.local.a\n",
                "local/__init__.py": "",
                "local/a.py": "",
            },
            "gradshare.encoding.e (encoding) imports gradshare.local.a (local)",
        ),
        (  # 0.1's circle: integrations.py <-> _lightning.py, one of them lazily
            {
                "integrations.py": "def __getattr__(n):\n    from gradshare._lightning import S\n",
                "_lightning.py": "from gradshare.integrations import f\n",
            },
            "import circle: gradshare._lightning -> gradshare.integrations -> gradshare._lightning",
        ),
        (  # another subpackage's private module
            {
                "codec/__init__.py": "",
                "codec/_flat.py": "",
                "distributed/__init__.py": "",
                "distributed/x.py": "from gradshare.codec._flat import slices\n",
            },
            "gradshare.distributed.x imports gradshare.codec._flat, a private module of "
            "gradshare.codec",
        ),
        (  # relative imports are resolved
            {
                "local/__init__.py": "",
                "local/p.py": "from ..integrations import rank_files\n",
                "integrations/__init__.py": "",
                "integrations/rank_files.py": "",
            },
            "gradshare.local.p (local) imports gradshare.integrations.rank_files (integrations)",
        ),
    ],
)
def test_the_check_finds_an_upward_import_and_a_circle(
    tmp_path: Path, files: dict[str, str], expect: str
) -> None:
    found = violations(_tree(tmp_path, files))
    assert any(expect in f for f in found), found
