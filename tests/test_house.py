"""The house rules that a linter does not hold: sizes, the layering's exceptions, the docs' lists.

A function over ``FUNCTION_LINES`` lines of code (its docstring not counted:
docstrings say why, and the project wants them) or a module over
``MODULE_LINES`` lines is a finding unless it is listed below with the reason
it is still one piece; so is a function over cyclomatic complexity
``COMPLEXITY`` as radon counts it (``COMPLEX_FUNCTIONS``). A listed one that
has since shrunk, or gone, fails too: the lists only ever get shorter. Ruff's C90 and PLR0915 hold the
branches and statements the same way (``# noqa`` with the reason, where the
function is defined).
"""

from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "backroom"
FUNCTION_LINES = 80
MODULE_LINES = 500

# "path::qualified.name" -> why it is one piece.
LONG_FUNCTIONS: dict[str, str] = {
    "model/adapters.py::_download": "one streamed fetch: each size and time bound is a branch",
}

# "path" -> why it is one module.
LONG_MODULES: dict[str, str] = {
    "agents/llm.py": "the llm kind: requests with retries and deadlines, accounting, traces",
    "games/kuhn.py": "Kuhn poker: the classic and Loki variants over one state",
    "human/tty.py": "the terminal kind: its input line, toolbar and turn handling",
    "model/adapters.py": "fetching, verifying and caching a LoRA adapter",
    "referee/match.py": "one match: turns, deadlines, channels, eavesdroppers",
    "replay/index.py": "the replay index: build, refresh and query one file",
    "solvers/tree.py": "the explicit game tree and its array form, used by every solver",
    "trainer/dpo.py": "DPO: preference pairs from episodes and TRL's trainer",
    "trainer/loop.py": "the training loop and the step's bookkeeping around it",
    "trainer/store.py": "the trainer's SQLite store: its schema and every query",
}


#: Cyclomatic complexity as radon counts it: ruff's C901 misses boolean operators (each
#: ``and`` / ``or`` is a branch a test must take), so a function can pass ruff at 30.
COMPLEXITY = 15

# "path::qualified.name" -> why it is still one piece (or where it gets split).
COMPLEX_FUNCTIONS: dict[str, str] = {}


def _modules() -> Iterator[Path]:
    yield from sorted(PACKAGE.rglob("*.py"))


def _code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the first decorator to the end, less the docstring's."""
    start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    lines = (node.end_lineno or node.lineno) - start + 1
    first = node.body[0]
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        lines -= (first.end_lineno or first.lineno) - first.lineno + 1
    return lines


def _functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, int]]:
    """(qualified name, lines of code) of every function, nested ones too."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield prefix + node.name, _code_lines(node)
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def test_long_functions_are_listed_with_a_reason() -> None:
    found = {}
    for path in _modules():
        rel = path.relative_to(PACKAGE).as_posix()
        for name, lines in _functions(ast.parse(path.read_text(), str(path))):
            if lines > FUNCTION_LINES:
                found[f"{rel}::{name}"] = lines
    unlisted = {k: n for k, n in found.items() if k not in LONG_FUNCTIONS}
    assert not unlisted, (
        f"functions over {FUNCTION_LINES} lines of code: {unlisted}; split them "
        "(or list one in LONG_FUNCTIONS with the reason it is one piece)"
    )
    stale = sorted(set(LONG_FUNCTIONS) - set(found))
    assert not stale, f"listed in LONG_FUNCTIONS but short now (or gone): {stale}; remove them"


def test_long_modules_are_listed_with_a_reason() -> None:
    found = {}
    for path in _modules():
        lines = len(path.read_text().splitlines())
        if lines > MODULE_LINES:
            found[path.relative_to(PACKAGE).as_posix()] = lines
    unlisted = {k: n for k, n in found.items() if k not in LONG_MODULES}
    assert not unlisted, (
        f"modules over {MODULE_LINES} lines: {unlisted}; split them by concern "
        "(or list one in LONG_MODULES with the reason it is one job)"
    )
    stale = sorted(set(LONG_MODULES) - set(found))
    assert not stale, f"listed in LONG_MODULES but short now (or gone): {stale}; remove them"


def _complexities(source: str) -> Iterator[tuple[str, int]]:
    """(qualified name, radon's cyclomatic complexity) of every function, nested ones too."""
    from radon.visitors import ComplexityVisitor

    def walk(function: Any, prefix: str) -> Iterator[tuple[str, int]]:
        yield prefix + function.name, function.complexity
        for inner in function.closures:
            yield from walk(inner, f"{prefix}{function.name}.")

    visitor = ComplexityVisitor.from_code(source)
    for function in visitor.functions:
        yield from walk(function, "")
    for cls in visitor.classes:
        for method in cls.methods:
            yield from walk(method, f"{cls.name}.")


def test_complex_functions_are_listed_with_a_reason() -> None:
    found = {}
    for path in _modules():
        rel = path.relative_to(PACKAGE).as_posix()
        for name, complexity in _complexities(path.read_text()):
            if complexity > COMPLEXITY:
                found[f"{rel}::{name}"] = complexity
    unlisted = {k: n for k, n in found.items() if k not in COMPLEX_FUNCTIONS}
    assert not unlisted, (
        f"functions over cyclomatic complexity {COMPLEXITY} (radon): {unlisted}; split them "
        "(or list one in COMPLEX_FUNCTIONS with the reason it is one piece)"
    )
    stale = sorted(set(COMPLEX_FUNCTIONS) - set(found))
    assert not stale, f"listed in COMPLEX_FUNCTIONS but simpler now (or gone): {stale}; remove them"


def test_the_complexity_count_sees_boolean_operators() -> None:
    """What ruff's C901 misses: ``a and b or c`` is three paths, not one."""
    source = "def f(a, b, c):\n    return a and b or c\n"
    assert dict(_complexities(source)) == {"f": 3}


def test_every_exception_has_a_reason() -> None:
    for name, reason in {**LONG_FUNCTIONS, **LONG_MODULES, **COMPLEX_FUNCTIONS}.items():
        assert len(reason.split()) >= 4 and "\n" not in reason, f"{name}: a one-line reason"


def test_the_layering_has_no_exceptions() -> None:
    """The layers and the no-cycle contracts list no ignored import: no cycle is tolerated."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"][
        "contracts"
    ]
    checked = [c for c in contracts if c["type"] in ("layers", "acyclic_siblings")]
    assert {c["type"] for c in checked} == {"layers", "acyclic_siblings"}, "a contract is gone"
    for contract in checked:
        exempt = {k: v for k, v in contract.items() if k.startswith(("ignore", "exclude"))}
        assert not exempt, f"{contract['name']!r} has exceptions: {exempt}"


# --- docs/architecture.md is kept true ------------------------------------------------

ARCHITECTURE = ROOT / "docs" / "architecture.md"
METRIC_KINDS = {"Counter", "Histogram", "Gauge", "Summary"}


def _section(doc: str, heading: str) -> str:
    start = doc.index(f"\n## {heading}")
    end = doc.find("\n## ", start + 1)
    return doc[start : end if end != -1 else None]


def _metrics_in_code() -> dict[str, tuple[str, ...]]:
    """Every ``backroom_*`` metric defined in the package, with its label names."""
    out: dict[str, tuple[str, ...]] = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            func = node.func
            kind = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            name = node.args[0]
            if kind not in METRIC_KINDS or not isinstance(name, ast.Constant):
                continue
            if not str(name.value).startswith("backroom_"):
                continue
            labels = node.args[2] if len(node.args) > 2 else None
            for kw in node.keywords:
                if kw.arg == "labelnames":
                    labels = kw.value
            assert labels is None or isinstance(labels, ast.List | ast.Tuple), path
            out[str(name.value)] = tuple(
                str(e.value) for e in (labels.elts if labels else []) if isinstance(e, ast.Constant)
            )
    return out


def _metrics_in_docs(text: str) -> dict[str, tuple[str, ...]]:
    """``backroom_name{label,...}`` as the docs write them (the pattern ``backroom_<thing>`` aside)."""
    out = {}
    for m in re.finditer(r"`(backroom_[a-z_]+)(?:\{([a-z_,]+)\})?`", text):
        out[m.group(1)] = tuple(m.group(2).split(",")) if m.group(2) else ()
    return out


def test_architecture_lists_every_metric_with_its_labels() -> None:
    """The Metrics section names every metric (the trainer's in docs/training.md), labels too."""
    docs = _metrics_in_docs(_section(ARCHITECTURE.read_text(), "Metrics"))
    training = (ROOT / "docs" / "training.md").read_text()
    docs.update(
        {k: v for k, v in _metrics_in_docs(training).items() if k.startswith("backroom_train_")}
    )
    code = _metrics_in_code()
    assert len(code) > 30  # the walk finds the definitions at all
    assert set(docs) - set(code) == set(), "documented but not defined"
    assert set(code) - set(docs) == set(), "defined but not in docs/architecture.md's Metrics"
    assert {k: v for k, v in docs.items() if code[k] != v} == {}, (
        "labels differ from the code's",
        {k: code[k] for k, v in docs.items() if code[k] != v},
    )


def _layout() -> dict[str, str]:
    """The package layout block: each ``backroom/...`` entry and the text describing it."""
    block = _section(ARCHITECTURE.read_text(), "Package layout").split("```")[1]
    entries: dict[str, str] = {}
    current = None
    for line in block.splitlines():
        m = re.match(r"(backroom/\S*)\s*(.*)", line)
        if m:
            current = m.group(1)
            entries[current] = m.group(2)
        elif current and line.startswith(" "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


def _covered(rel: str, text: str) -> bool:
    """Whether ``rel`` (a module's path inside its entry) is named: its name, a glob, its folder."""
    named = set(re.findall(r"[\w*]+\.py\b", text))
    folders = set(re.findall(r"(\w+)/", text))
    parts = rel.split("/")
    return any(Path(parts[-1]).match(n) for n in named) or any(p in folders for p in parts[:-1])


PACKAGES = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))


@pytest.mark.parametrize("entry", PACKAGES)
def test_layout_block_names_every_module_of_each_package(entry: str) -> None:
    """Every module of these packages is in the layout block, and every module named there exists."""
    layout = _layout()
    assert f"backroom/{entry}/" in layout, (
        f"docs/architecture.md's layout block lacks backroom/{entry}/"
    )
    text = layout[f"backroom/{entry}/"]
    folder = PACKAGE / entry
    modules = [
        p.relative_to(folder).as_posix() for p in folder.rglob("*.py") if p.name != "__init__.py"
    ]
    missing = [m for m in modules if not _covered(m, text)]
    assert not missing, f"docs/architecture.md's layout block lacks backroom/{entry}/{missing}"
    names = {p.name for p in folder.rglob("*.py")}
    ghosts = [n for n in re.findall(r"\b\w+\.py\b", text) if n not in names]
    assert not ghosts, f"the layout block names backroom/{entry}/{ghosts}, which do not exist"


def test_layout_block_names_every_top_level_module() -> None:
    layout = _layout()
    modules = [p.name for p in PACKAGE.glob("*.py") if not p.name.startswith("__")]
    missing = [m for m in modules if f"backroom/{m}" not in layout]
    assert not missing, f"docs/architecture.md's layout block lacks backroom/{missing}"
    ghosts = [e for e in layout if e.endswith(".py") and not (ROOT / e).is_file()]
    assert not ghosts, f"the layout block names {ghosts}, which do not exist"
