"""The package's imports run one way, down the data flow: runtime → parallel → moe → models →
engine → applications. A module may import its own level or any level below, never one above."""

import ast
import shutil
from pathlib import Path

import moeshard

PACKAGE = Path(moeshard.__file__).parent
LEVELS = {
    "runtime": 0,  # custom ops and compile-once, derived-tensor registry, memory
    "bundled": 0,  # the bundled model and task: data
    "commandline": 0,  # argparse helpers every command group shares
    "parallel": 1,
    "kernels": 1,  # the bf16 CPU kernels and their packed weights (derived tensors)
    "moe": 2,
    "models": 3,
    "engine": 4,
    "verify": 5,
    "bench": 5,
    "demos": 5,
    "serve": 5,
    "cli": 6,
    "__main__": 6,
}


def level_of(module: str) -> int | None:
    """`moeshard.<top>.…` → the level of <top>; the package root (`moeshard`) has none."""
    parts = module.split(".")
    if parts[0] != "moeshard" or len(parts) == 1:
        return None
    return LEVELS[parts[1]]


def imports_of(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, node.module)]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return [(line, name) for line, name in found if name.split(".")[0] == "moeshard"]


def module_name(path: Path, package: Path) -> str:
    rel = path.relative_to(package.parent).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def upward_imports(package: Path = PACKAGE) -> list[str]:
    bad = []
    for path in sorted(package.rglob("*.py")):
        here = level_of(module_name(path, package))
        if here is None:
            continue  # moeshard/__init__.py re-exports the engine's names lazily
        for line, target in imports_of(path):
            there = level_of(target)
            if there is not None and there > here:
                bad.append(f"{path.relative_to(package)}:{line} imports {target} (level {there} > {here})")
    return bad


def test_every_top_level_folder_has_a_level():
    tops = {p.stem for p in PACKAGE.iterdir() if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py"}
    assert tops - {"__init__"} <= set(LEVELS), sorted(tops - set(LEVELS) - {"__init__"})


def test_imports_run_down_the_flow():
    assert upward_imports() == []


def test_the_check_can_fail(tmp_path):
    """An upward import planted in a copy of the package is caught."""
    copy = tmp_path / "moeshard"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("bundled", "__pycache__"))
    (copy / "moe" / "planted.py").write_text("def f():\n    from moeshard.engine import LLM\n")
    assert upward_imports(copy) == ["moe/planted.py:2 imports moeshard.engine (level 4 > 2)"]
