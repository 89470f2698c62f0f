"""Reproducible fetch + extraction of the public-domain training corpus from the Debian archive.

    python -m hybridserve.train.corpus --out data/corpus [--no-web]

Sources (both public-domain texts):
  * ``r-cran-janeaustenr`` (package MIT): Jane Austen's six novels as R character vectors.
  * ``sword-text-web`` (packaging GPL-2+, text public domain): the World English Bible.

Writes ``train.jsonl`` (one document per line: source, title, text), ``heldout.txt`` (the last
``--heldout-fraction`` of every Austen novel, never trained on) and ``stats.json``.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from hybridserve.train.rdata import read_lazyload_db
from hybridserve.train.sword import read_module

AUSTEN_PACKAGE = "r-cran-janeaustenr"
WEB_PACKAGE = "sword-text-web"
AUSTEN_DATA = "usr/lib/R/site-library/janeaustenr/data"
WEB_MODULE = "usr/share/sword/modules/texts/ztext/engWEB2015eb"
HELDOUT_SEPARATOR = "\n\n\n"
_SPACES = re.compile(r"[ \t]+")


@dataclass(frozen=True)
class Document:
    source: str
    title: str
    text: str


def fetch_deb(package: str, workdir: Path) -> Path:
    """``apt-get download`` a package into ``workdir`` and ``dpkg-deb -x`` it; returns the tree root."""
    workdir.mkdir(parents=True, exist_ok=True)
    root = workdir / package
    if root.exists():
        return root
    if not list(workdir.glob(f"{package}_*.deb")):
        subprocess.run(["apt-get", "download", package], cwd=workdir, check=True)
    deb = sorted(workdir.glob(f"{package}_*.deb"))[-1]
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    return root


def lines_to_paragraphs(lines: Iterable[str | None]) -> str:
    """Join hard-wrapped lines into paragraphs separated by one blank line."""
    paragraphs: list[str] = []
    current: list[str] = []
    for line in lines:
        line = (line or "").strip()
        if line:
            current.append(line)
        elif current:
            paragraphs.append(_SPACES.sub(" ", " ".join(current)))
            current = []
    if current:
        paragraphs.append(_SPACES.sub(" ", " ".join(current)))
    return "\n\n".join(paragraphs)


def austen_documents(root: Path) -> list[Document]:
    data = root / AUSTEN_DATA
    novels = read_lazyload_db(data / "Rdata.rdx", data / "Rdata.rdb")
    return [Document("austen", name, lines_to_paragraphs(obj.value)) for name, obj in sorted(novels.items())]


def web_documents(root: Path) -> list[Document]:
    return [Document("web", title, text) for title, text in read_module(root / WEB_MODULE)]


def split_tail(doc: Document, fraction: float) -> tuple[Document, str]:
    """Split off the last ``fraction`` of a document's characters, on a paragraph boundary."""
    cut = doc.text.rfind("\n\n", 0, int(len(doc.text) * (1.0 - fraction)))
    head, tail = doc.text[:cut], doc.text[cut:].strip()
    return Document(doc.source, doc.title, head), tail


def build(out: Path, workdir: Path, with_web: bool, heldout_fraction: float) -> dict[str, int]:
    docs = austen_documents(fetch_deb(AUSTEN_PACKAGE, workdir))
    train, heldout = [], []
    for doc in docs:
        head, tail = split_tail(doc, heldout_fraction)
        train.append(head)
        heldout.append(tail)
    if with_web:
        train.extend(web_documents(fetch_deb(WEB_PACKAGE, workdir)))
    out.mkdir(parents=True, exist_ok=True)
    with (out / "train.jsonl").open("w", encoding="utf-8") as f:
        for doc in train:
            f.write(json.dumps(asdict(doc), ensure_ascii=False) + "\n")
    (out / "heldout.txt").write_text(HELDOUT_SEPARATOR.join(heldout) + "\n", encoding="utf-8")
    stats = {f"{d.source}_chars": 0 for d in train}
    for d in train:
        stats[f"{d.source}_chars"] += len(d.text)
    stats["heldout_chars"] = sum(len(t) for t in heldout)
    (out / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    return stats


def read_documents(path: Path) -> list[Document]:
    with path.open(encoding="utf-8") as f:
        return [Document(**json.loads(line)) for line in f if line.strip()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("data/corpus"))
    parser.add_argument("--workdir", type=Path, default=Path("data/debs"), help="where .debs are unpacked")
    parser.add_argument("--no-web", action="store_true", help="Austen only")
    parser.add_argument("--heldout-fraction", type=float, default=0.04)
    args = parser.parse_args(argv)
    stats = build(args.out, args.workdir, not args.no_web, args.heldout_fraction)
    print(json.dumps(stats))


if __name__ == "__main__":
    main()
