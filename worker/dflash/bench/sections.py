"""Generated sections of a page: the text between `<!-- NAME:start -->` and `<!-- NAME:end -->`,
which a generator (a bench, a report) replaces whole. The generators import this module, not
each other (dflash.bench.readme writes the results tables; dflash.bench.llamacpp and
dflash.bench.every_backend the CPU page's tables)."""

from __future__ import annotations

import sys
from pathlib import Path

SECTION = "bench-results"
DOCS = "docs"


def markers(name: str = SECTION) -> tuple[str, str]:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


START, END = markers()


def _has(path: Path, start: str, end: str) -> bool:
    if not path.is_file():
        return False
    text = path.read_text()
    return start in text and end in text


def find_document(start: str, end: str, root: Path = Path(".")) -> Path:
    """README.md or the docs/*.md page under `root` that holds both markers."""
    candidates = [root / "README.md", *sorted((root / DOCS).glob("*.md"))]
    found = [p for p in candidates if _has(p, start, end)]
    if not found:
        raise SystemExit(f"neither {root / 'README.md'} nor {root / DOCS}/*.md has {start} ... {end} markers")
    if len(found) > 1:
        raise SystemExit(f"{start} ... {end} markers are in several files: {', '.join(map(str, found))}")
    return found[0]


def replace_section(readme: Path, start: str, end: str, body: str) -> Path:
    """Replace the text from marker `start` through marker `end` with `body` (which carries
    the markers again) and return the file written. A file without the markers hands over
    to the page of the docs/ folder beside it that has them (sections moved out of the
    README keep their generators' `--readme README.md` working)."""
    readme = Path(readme)
    if not _has(readme, start, end):
        moved = [p for p in sorted((readme.parent / DOCS).glob("*.md")) if _has(p, start, end)]
        if len(moved) != 1:
            raise SystemExit(f"{readme} has no {start} ... {end} markers")
        print(f"{readme} has no {start} markers; writing them in {moved[0]}", file=sys.stderr)
        readme = moved[0]
    text = readme.read_text()
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    readme.write_text(head + body + tail)
    return readme
