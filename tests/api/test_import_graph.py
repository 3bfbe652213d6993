"""The import graph of service/api, read with ast: no cycle, and the shared layer below the
protocol packages."""

from __future__ import annotations

import ast
from pathlib import Path

API = Path(__file__).resolve().parents[2] / "service" / "api"
PACKAGE = "service.api"
# lazy on purpose: the supervisor imports service.api.worker and stays without FastAPI
LAZY = {"service.api.worker"}


def module_name(path: Path) -> str:
    parts = path.relative_to(API.parents[1]).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> list[tuple[str, str]]:
    """The service.api modules `path` imports, each with where: "function", "typing" (under
    `if TYPE_CHECKING:`) or "module"."""
    tree = ast.parse(path.read_text())
    where = {id(n): "typing" for f in ast.walk(tree) if isinstance(f, ast.If)
             and ast.unparse(f.test) == "TYPE_CHECKING" for n in ast.walk(f)}
    where |= {id(n): "function" for f in ast.walk(tree)
              if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(f)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]
            targets = [n for n in names if n in modules] or [node.module]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        out += [(t, where.get(id(node), "module")) for t in targets if t in modules]
    return out


def graph() -> dict[str, dict[str, str]]:
    """importer -> {imported: where} over the modules of service/api."""
    files = {module_name(p): p for p in API.rglob("*.py")}
    return {name: dict(imports(path, set(files))) for name, path in files.items()}


def cycle(g: dict[str, dict[str, str]]) -> list[str] | None:
    """One import cycle of `g`, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in g.get(node, {}):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    return next((c for n in sorted(g) if n not in state and (c := visit(n, [n]))), None)


def test_no_import_cycle() -> None:
    assert cycle(graph()) is None


def test_no_function_level_imports_within_api() -> None:
    lazy = {(a, b) for a, targets in graph().items() for b, where in targets.items()
            if where == "function"}
    assert {a for a, _ in lazy} <= LAZY, sorted(lazy)


def test_shared_layer_imports_no_protocol_package() -> None:
    """Only the app includes the protocol packages' routers; the rest of service/api is shared."""
    g = graph()
    packages = {m for m in g if m.count(".") == 2 and any(k.startswith(m + ".") for k in g)}
    shared = {m for m in g if m.count(".") == 2 and m not in packages} - {"service.api.app"}
    wrong = {(a, b) for a in shared for b in g[a]
             if any(b == p or b.startswith(p + ".") for p in packages)}
    assert packages and not wrong, (packages, sorted(wrong))
