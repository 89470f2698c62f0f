"""The docs stay a map: README.md short, and every relative link in README.md and docs/ resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_the_readme_stays_short() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(doc: Path) -> None:
    targets = [t for t in LINK.findall(doc.read_text()) if "://" not in t]
    missing = [t for t in targets if not (doc.parent / t).exists()]
    assert not missing, f"{doc.name} links to missing files: {missing}"


def test_no_link_leaves_the_repository() -> None:
    for doc in DOCS:
        for target in LINK.findall(doc.read_text()):
            if "://" not in target:
                assert (doc.parent / target).resolve().is_relative_to(ROOT), f"{doc.name}: {target}"


# The architecture map names every package, and every module of the packages the engine is built from.
MAPPED_IN_FULL = ("engine", "cache", "models", "kv_transfer", "distributed", "router")


def test_the_architecture_map_names_what_exists() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    package = ROOT / "hybridserve"
    folders = [
        p.parent for p in package.rglob("__init__.py") if p.parent != package and "assets" not in p.parts
    ]
    missing = [f"{f.name}/" for f in folders if f"{f.name}/" not in doc]
    for name in MAPPED_IN_FULL:
        missing += [
            str(p.relative_to(package))
            for p in (package / name).rglob("*.py")
            if p.name != "__init__.py" and p.stem not in doc
        ]
    assert not missing, f"docs/architecture.md does not name: {missing}"
