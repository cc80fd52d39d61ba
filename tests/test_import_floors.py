"""The four packages stand on floors, and no module imports a package above its own:
rl_hooks -> longctx_moe -> cp_attention -> data_packing. Every import statement counts, including
the ones inside functions (a lazy import still runs up a floor when it runs)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLOORS = {"data_packing": 0, "cp_attention": 1, "longctx_moe": 2, "rl_hooks": 3}


def imported_packages(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, top-level package) of every absolute import in `tree`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def upward_imports(package: str) -> list[str]:
    floor = FLOORS[package]
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for line, top in imported_packages(ast.parse(path.read_text(), str(path))):
            if FLOORS.get(top, -1) > floor:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {top}")
    return bad


@pytest.mark.parametrize("package", sorted(FLOORS, key=FLOORS.get))
def test_no_module_imports_a_higher_floor(package):
    assert upward_imports(package) == []


def test_the_walk_sees_imports_inside_functions():
    tree = ast.parse("def f():\n    from rl_hooks.demo import main\n\nimport data_packing.batch\n")
    assert sorted(imported_packages(tree)) == [(2, "rl_hooks"), (4, "data_packing")]
