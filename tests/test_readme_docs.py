"""The README stays a front page and its links and generated blocks keep working.

README.md is what a newcomer reads: at most 500 lines, with the two commands. Everything
else lives in docs/. Every relative link in README.md and docs/*.md must name a file or
folder that exists (anchors are not checked), and every block a generator writes between
markers must be found by `dflash.bench.readme` where its generator looks for it.
"""

import re
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def links(text: str) -> list[str]:
    """Link and image targets outside code blocks and code spans."""
    text = INLINE_CODE.sub("", FENCE.sub("", text))
    return LINK.findall(text)


def is_relative(target: str) -> bool:
    return not (re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith(("#", "/")))


def test_readme_is_short_and_has_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 500, f"README.md has {len(text.splitlines())} lines; move detail to docs/"
    assert "make demo" in text and "make test" in text


def test_the_link_checker_finds_links():
    sample = "[a](docs/x.md#y) ![b](img.png) `[c](not-a-link)`\n```\n[d](nor-this)\n```\n[e\nf](g.md) [h](https://x)"
    assert links(sample) == ["docs/x.md#y", "img.png", "g.md", "https://x"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    targets = [t for t in links(page.read_text()) if is_relative(t)]
    missing = [t for t in targets if not (page.parent / t.split("#", 1)[0]).exists()]
    assert not missing, f"{page.relative_to(REPO)} links to missing files: {missing}"


# Each generated block: the generator's markers, and the file its `--readme` (or its
# default) names. `replace_section` hands a README without the markers over to the docs/
# page that has them.
GENERATED = {
    "bench-results": "README.md",  # python -m dflash.bench.readme RUN/results.json (finds docs/benchmarks.md)
    "current-results": "README.md",  # ... --section current-results
    "peers-results": "docs/benchmarks.md",  # make peers: --readme docs/benchmarks.md
    "learning-results": "README.md",  # python -m tools.learning --readme README.md (as recorded)
}


@pytest.mark.parametrize("name", sorted(GENERATED))
def test_generated_blocks_are_found_by_their_generators(name, tmp_path):
    from dflash.bench.readme import find_document, markers, replace_section

    start, end = markers(name)
    holders = [p for p in PAGES if start in p.read_text() and end in p.read_text()]
    assert len(holders) == 1, f"{name}: markers in {holders}"
    assert find_document(start, end, REPO) == holders[0]
    # Write through a copy of the tree's pages, from the path the generator is given.
    for page in PAGES:
        dest = tmp_path / page.relative_to(REPO)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(page, dest)
    written = replace_section(tmp_path / GENERATED[name], start, end, f"{start}\nnew table\n{end}")
    assert written == tmp_path / holders[0].relative_to(REPO)
    assert "new table" in written.read_text()
    assert written.read_text().count(start) == 1


def test_makefile_peers_writes_where_the_markers_are():
    line = next(x for x in (REPO / "Makefile").read_text().splitlines() if "dflash.bench.peers" in x)
    target = re.search(r"--readme (\S+)", line).group(1)
    assert "<!-- peers-results:start -->" in (REPO / target).read_text()


def test_the_privilege_matrix_stays_in_the_readme():
    """tests/test_security.py reads it from README.md."""
    text = README.read_text()
    assert "<!-- privilege-matrix:start -->" in text and "<!-- privilege-matrix:end -->" in text
