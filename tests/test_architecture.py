"""The code's import structure: no cycles, and dependencies point one way.

`service -> engine -> grammar`: grammar imports nothing of engine or service,
engine nothing of service; within engine/ and grammar/ no module depends on
itself through others. Imports are read with `ast`, so the ones inside
functions and under `TYPE_CHECKING` count too: a cycle that only closes at
call time is still a cycle. Run as a script to print the graph and any cycles.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "grammar", "service")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    """Every module of the project's packages (generated stubs excluded)."""
    return {_module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))
            if "gen" not in p.relative_to(ROOT).parts}


def imported(tree: ast.AST, module: str, is_package: bool, modules: set[str] | frozenset[str]) -> set[str]:
    """Every module `tree` imports (absolute names), wherever the import statement is.

    `from X import name` counts as importing `X.name` when that is a module,
    and `X` itself otherwise (`name` is then read from X's namespace).
    """
    package_parts = module.split(".") if is_package else module.split(".")[:-1]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package_parts[: len(package_parts) - node.level + 1]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                names.add(submodule if submodule in modules else base)
    return names


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports."""
    files = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        found = imported(tree, module, path.name == "__init__.py", set(files))
        graph[module] = {name for name in found if name in files and name != module}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per back edge found by a depth-first search (empty: acyclic)."""
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def _package(module: str) -> str:
    return module.split(".", 1)[0]


def test_no_import_cycles() -> None:
    assert find_cycles(import_graph()) == []


def test_dependencies_point_from_service_to_engine_to_grammar() -> None:
    allowed = {"grammar": {"grammar"}, "engine": {"engine", "grammar"},
               "service": {"service", "engine", "grammar"}}
    wrong = sorted(f"{m} -> {d}" for m, deps in import_graph().items() for d in deps
                   if _package(d) not in allowed[_package(m)])
    assert wrong == []


# service/'s subpackages, and which of them each may import (besides itself,
# engine, grammar, the generated stubs and the core modules at service/'s top:
# engine_loop, errors, interceptors, structured, address). The assembly (server, loading) may import
# any of them; only the CLI imports the assembly.
SERVICE_LAYERS = {
    "service.ops": set(),
    "service.security": {"service.ops"},
    "service.api": {"service.ops", "service.security"},
    # The vLLM protocol serves its calls through the stencil.v1 generation path.
    "service.vllm_protocol": {"service.ops", "service.security", "service.api"},
    # The engine process and the server's side of it: the engine loop's driver and link.
    "service.engine_proc": {"service.ops"},
    "service.cli": {"service.ops", "service.security", "service.api", "service.vllm_protocol",
                    "service.server", "service.loading", "service.engine_proc"},
}
SERVICE_CORE = {"service.engine_loop", "service.errors", "service.interceptors", "service.structured",
                "service.address"}


def _service_part(module: str) -> str:
    """The subpackage (service.api, ...) or top-level module (service.server) a service module is in."""
    return ".".join(module.split(".")[:2])


def test_service_subpackages_depend_in_layers() -> None:
    graph = import_graph()
    wrong = []
    for module, deps in graph.items():
        part = _service_part(module)
        if _package(module) != "service" or part not in SERVICE_LAYERS:
            continue
        allowed = SERVICE_LAYERS[part] | SERVICE_CORE | {part}
        wrong += [f"{module} -> {d}" for d in deps if _package(d) == "service" and _service_part(d) not in allowed]
    assert wrong == []
    # The core serves both protocols: it imports no protocol, CLI or assembly module.
    core_wrong = [f"{m} -> {d}" for m in SERVICE_CORE for d in graph[m] if _package(d) == "service"
                  and _service_part(d) not in SERVICE_CORE | {"service.ops", "service.security"}]
    assert core_wrong == []
    assert {_service_part(m) for m in graph if _package(m) == "service"} <= \
        set(SERVICE_LAYERS) | SERVICE_CORE | {"service", "service.server", "service.loading", "service.protogen"}


def test_the_core_and_the_shared_layers_import_no_protocol_stubs() -> None:
    # The layer check above sees project modules only, not the generated
    # stubs: the core held stencil.v1's constraint conversion (it imported
    # generate_pb2) while the docs said it imported no protocol.
    files = _modules()
    shared = ("service.ops", "service.security", "service.engine_proc")
    wrong = []
    for module, path in files.items():
        if module in SERVICE_CORE or _service_part(module) in shared:
            found = imported(ast.parse(path.read_text()), module, path.name == "__init__.py", set(files))
            wrong += [f"{module} -> {name}" for name in found if name.startswith("service.gen")]
    assert wrong == []


def test_the_assembly_imports_no_cli() -> None:
    graph = import_graph()
    wrong = [f"{m} -> {d}" for m in ("service.server", "service.loading") for d in graph[m]
             if _service_part(d) == "service.cli"]
    assert wrong == []


def test_grammar_tokenizer_data_is_library_neutral() -> None:
    # Each grammar backend builds its own tokenizer object from TokenizerData.
    path = ROOT / "grammar" / "tokenizer.py"
    found = imported(ast.parse(path.read_text()), "grammar.tokenizer", False, set(_modules()))
    assert not found & {"grammar._xgr", "grammar._llg", "xgrammar", "llguidance"}


def test_the_checker_sees_imports_inside_functions() -> None:
    tree = ast.parse("def f():\n    from . import _xgr\n    from ..grammar.spec import X\n")
    found = imported(tree, "grammar.tokenizer", False, {"grammar._xgr"})
    assert found == {"grammar._xgr", "grammar.spec"}
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_an_installed_package_carries_the_files_it_reads_at_run_time() -> None:
    # A non-editable install (a wheel) left out the CPU kernels' C++ sources,
    # and the CPU path quietly fell back to plain torch.
    import fnmatch
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    needed = [*(ROOT / "engine/kernels/cpu").glob("*.cpp"), *(ROOT / "engine/kernels/cpu").glob("*.h")]
    assert needed
    for path in needed:
        rel = path.relative_to(ROOT)
        covered = any(fnmatch.fnmatch(str(rel), f"{package.replace('.', '/')}/{glob}")
                      for package, globs in data.items() if package != "*" for glob in globs)
        assert covered, f"{rel} is not in [tool.setuptools.package-data]"


if __name__ == "__main__":
    graph = import_graph()
    for name in sorted(graph):
        print(f"{name} -> {', '.join(sorted(graph[name])) or '-'}")
    cycles = find_cycles(graph)
    for cycle in cycles:
        print("CYCLE:", " -> ".join(cycle))
    print(f"{len(graph)} modules, {len(cycles)} cycle(s)")
    sys.exit(1 if cycles else 0)
