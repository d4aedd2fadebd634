"""The package's layering, read from the code's own imports (``ast``, nothing imported).

Each rule below can fail: it names the file and the import that breaks it.

    convo/models/     the leaf: shapes, dtypes, quantization, defaults, generation types.
                      Imports only ``convo.errors``.
    convo/planner/    \\ both import models/, never each other, never engines/.
    convo/fast/       /
    engines/base.py, session, summarize: nothing from fast/ (priority travels in the
                      generate options).
    the CLI           a client of the library: nothing outside ``convo.cli`` imports it.
    everywhere        no ``from convo ...`` inside a function (a lazy import is for an optional
                      third-party package), and no import circle between modules.
"""

from __future__ import annotations

import ast
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "convo"

#: A library file past this many lines holds two concepts (STYLE.md: ~800 lines).
MAX_FILE_LINES = 1000


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, dotted
    target: str  # the imported module, dotted (``from a import b`` -> ``a`` or ``a.b``)
    line: int
    in_function: bool
    type_checking: bool


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _imports(module: str, path: Path, modules: Collection[str] = ()) -> Iterator[Import]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_package = path.name == "__init__.py"

    def visit(node: ast.AST, in_function: bool, type_checking: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            fn = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            tc = type_checking or (
                isinstance(child, ast.If)
                and isinstance(child.test, ast.Name | ast.Attribute)
                and "TYPE_CHECKING" in ast.unparse(child.test)
            )
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield Import(module, alias.name, child.lineno, fn, tc)
            elif isinstance(child, ast.ImportFrom):
                target = _resolve(module, is_package, child)
                for alias in child.names:
                    sub = f"{target}.{alias.name}"
                    # ``from convo.fast import decoder`` imports the module convo.fast.decoder
                    # (its package is only being initialised), ``from convo.fast import X``
                    # the package itself.
                    yield Import(module, sub if sub in modules else target, child.lineno, fn, tc)
            yield from visit(child, fn, tc)

    yield from visit(tree, False, False)


def _all_imports() -> list[Import]:
    mods = _modules()
    return [
        imp
        for name, path in mods.items()
        for imp in _imports(name, path, mods)
        if imp.target == "convo" or imp.target.startswith("convo.")
    ]


def _known(target: str, mods: dict[str, Path]) -> str | None:
    """The project module an import names (``from convo.x import Name`` -> ``convo.x``)."""
    return target if target in mods else None


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _where(imp: Import) -> str:
    return f"{imp.module}:{imp.line} imports {imp.target}"


def test_no_project_import_inside_a_function() -> None:
    offenders = sorted({_where(i) for i in _all_imports() if i.in_function and _known(i.target, _modules())})
    assert not offenders, offenders


def test_models_is_a_leaf() -> None:
    mods = _modules()
    assert "convo.models" in mods, "convo/models/ is the leaf package of shared facts"
    offenders = [
        _where(i)
        for i in _all_imports()
        if _within(i.module, "convo.models")
        and not i.type_checking  # a name for annotations only (ToolCall in Generation)
        and _known(i.target, mods)
        and not _within(i.target, "convo.models")
        and i.target not in ("convo", "convo.errors")
    ]
    assert not offenders, offenders


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("convo.planner", ("convo.fast", "convo.engines", "convo.session", "convo.server")),
        ("convo.fast", ("convo.planner", "convo.engines", "convo.session", "convo.server")),
        ("convo.engines.base", ("convo.fast",)),
        ("convo.session", ("convo.fast",)),
        ("convo.summarize", ("convo.fast",)),
    ],
)
def test_layers_do_not_reach_across(package: str, forbidden: tuple[str, ...]) -> None:
    mods = _modules()
    offenders = [
        _where(i)
        for i in _all_imports()
        if _within(i.module, package)
        and _known(i.target, mods)
        and any(_within(i.target, f) for f in forbidden)
    ]
    assert not offenders, offenders


def test_nothing_outside_the_cli_imports_it() -> None:
    mods = _modules()
    offenders = [
        _where(i)
        for i in _all_imports()
        if not _within(i.module, "convo.cli")
        and i.module != "convo.__main__"
        and _known(i.target, mods)
        and _within(i.target, "convo.cli")
    ]
    assert not offenders, offenders


def _circles() -> list[list[str]]:
    """Strongly connected components (more than one module) of the import graph that runs:
    module- and function-level imports, ``TYPE_CHECKING`` blocks left out."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for imp in _all_imports():
        target = _known(imp.target, mods)
        if target and not imp.type_checking and target != imp.module:
            graph[imp.module].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = iter(range(1 << 30))

    def strong(v: str) -> None:  # Tarjan
        index[v] = low[v] = next(counter)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_no_import_circle() -> None:
    assert _circles() == []


def test_no_library_file_is_past_the_size_of_one_concept() -> None:
    sizes = {
        str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines())
        for p in PACKAGE.rglob("*.py")
    }
    assert {p: n for p, n in sizes.items() if n > MAX_FILE_LINES} == {}


def test_the_checks_see_a_circle_and_an_import_in_a_function(tmp_path: Path) -> None:
    """The reader above is not blind: a synthetic function-level import is found."""
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from convo.fast import decoder\n", encoding="utf-8")
    found = list(_imports("convo.synthetic", path, {"convo.fast.decoder"}))
    assert any(i.in_function and i.target == "convo.fast.decoder" for i in found)


#: Capabilities an engine, a retriever or a summarizer declares (``convo.engines.base.Engine``,
#: ``convo.plan.Retriever``, ``convo.summarize.Summarizer``): read, never probed.
DECLARED = frozenset(
    {
        "agenerate",
        "close",
        "concurrent_calls",
        "decoder",
        "margin_tokens",
        "memory_report",
        "min_score",
        "planned_peak_reserved_bytes",
        "scheduler_stats",
        "supports_async",
        "supports_cancel",
        "supports_today",
        "supports_tools",
    }
)


def test_capabilities_are_read_not_probed() -> None:
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            args = node.args
            probe = name in ("getattr", "hasattr") and len(args) >= 2
            if probe and isinstance(args[1], ast.Constant) and args[1].value in DECLARED:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
            if name == "inspect.signature" and "forward" not in ast.unparse(args[0]):  # a torch model's
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert not offenders, offenders


#: Modules kept for one release so that old import paths work; convo itself never uses them.
SHIMS = frozenset(
    {
        "convo.store",
        "convo.engine",
        "convo.memory",
        "convo.decode",
        "convo.remote",
        "convo.engines.transformers",
        "convo.engines.kv",
        "convo.engines.models",
        "convo.planner.model",
    }
)


def test_convo_imports_no_deprecated_module() -> None:
    mods = _modules()
    assert SHIMS <= mods.keys(), SHIMS - mods.keys()
    offenders = sorted(
        {
            _where(i)
            for i in _all_imports()
            if i.target in SHIMS and i.module not in SHIMS and not i.type_checking
        }
    )
    assert not offenders, offenders
