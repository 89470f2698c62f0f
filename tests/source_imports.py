"""What a package's source files import and which attributes they read, parsed (ast), never imported."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "hybridserve"


def source_files(subpackage: str) -> list[Path]:
    """Every ``.py`` file under ``hybridserve/<subpackage>`` (``""``: the whole package)."""
    files = sorted((PACKAGE_ROOT / subpackage).rglob("*.py"))
    assert files, f"no Python files under hybridserve/{subpackage}"
    return files


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``, at any depth (lazy ones too)."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, node.module] if node.module else base)
            yield node.lineno, module
            yield from ((node.lineno, f"{module}.{alias.name}") for alias in node.names)


def attribute_reads(path: Path) -> Iterator[tuple[int, str]]:
    """(line, attribute name) of every ``x.name`` in ``path``."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute):
            yield node.lineno, node.attr


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")
