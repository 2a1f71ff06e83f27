"""The README stays a front page and its links and generated blocks keep working.

README.md is what a newcomer reads: at most 300 lines, with the two commands. Everything
else lives in docs/. Every relative link in README.md and every page under docs/ (the
investigations and docs/results' READMEs too) must name a file or folder that exists, and a
link into a Markdown page's `#anchor` a heading that page has; every block a generator
writes between markers must be found by `dflash.bench.readme` where its generator looks for
it, and README's results tables must be what `python -m dflash.bench.readme --current`
writes from docs/results/current/. docs/results/INDEX.md has a line per folder, naming
pages that do cite it; docs/investigations/README.md a row per investigation; every
`python -m MODULE` the pages and the Makefile name is a module that exists.
"""

import importlib.util
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]  # where generated blocks may live
LINKED = [README, *sorted((REPO / "docs").rglob("*.md")), REPO / "tools" / "README.md"]
RESULTS = REPO / "docs" / "results"
INVESTIGATIONS = REPO / "docs" / "investigations"
MAX_README_LINES = 300

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def links(text: str) -> list[str]:
    """Link and image targets outside code blocks and code spans."""
    text = INLINE_CODE.sub("", FENCE.sub("", text))
    return LINK.findall(text)


def is_relative(target: str) -> bool:
    return not (re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith(("#", "/")))


def anchors(text: str) -> set[str]:
    """The `#anchor`s of a Markdown page's headings, as GitHub makes them (a repeated
    heading's gets -1, -2, ...), and explicit `<a id=...>`s."""
    out, seen = set(), {}
    for line in FENCE.sub("", text).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out | set(re.findall(r'<a\s+(?:id|name)="([^"]+)"', text))


def test_readme_is_short_and_has_the_two_commands():
    text = README.read_text()
    n = len(text.splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; move detail to docs/"
    assert "```sh\nmake demo\n```" in text and "```sh\nmake test\n```" in text


def test_anchors_are_made_as_github_makes_them():
    text = "# A `make peers` run (Zen 4, 2026-12-05, 14:00)\n## What this says\n## What this says\n```\n# not\n```\n"
    assert anchors(text) == {"a-make-peers-run-zen-4-2026-12-05-1400", "what-this-says", "what-this-says-1"}


def test_the_link_checker_finds_links():
    sample = "[a](docs/x.md#y) ![b](img.png) `[c](not-a-link)`\n```\n[d](nor-this)\n```\n[e\nf](g.md) [h](https://x)"
    assert links(sample) == ["docs/x.md#y", "img.png", "g.md", "https://x"]


def _broken(page: Path) -> list[str]:
    """The page's relative links whose file is missing, or whose #anchor its Markdown target lacks."""
    bad = []
    for t in links(page.read_text()):
        if not (is_relative(t) or t.startswith("#")):
            continue
        path, _, frag = t.partition("#")
        target = page.parent / path if path else page
        if not target.exists():
            bad.append(t)
        elif frag and target.suffix == ".md" and frag not in anchors(target.read_text()):
            bad.append(t)
    return bad


@pytest.mark.parametrize("page", LINKED, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_and_their_anchors_resolve(page):
    bad = _broken(page)
    assert not bad, f"{page.relative_to(REPO)} links to missing files or anchors: {bad}"


def test_the_link_check_sees_a_missing_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n[ok](b.md#here) [gone](b.md#there) [self](#title) [no](#nope)\n")
    (tmp_path / "b.md").write_text("## Here\n")
    assert _broken(tmp_path / "a.md") == ["b.md#there", "#nope"]


# Each generated block: the generator's markers, and the file its `--readme` (or its
# default) names. `replace_section` hands a README without the markers over to the docs/
# page that has them.
GENERATED = {
    "bench-results": "README.md",  # python -m dflash.bench.readme RUN/results.json (finds docs/benchmarks.md)
    "current-results": "README.md",  # ... --section current-results
    "peers-results": "docs/benchmarks.md",  # make peers: --readme docs/benchmarks.md
    "learning-results": "README.md",  # python -m tools.learning --readme README.md (as recorded)
    **{f"results-{kind}": "README.md" for kind in ("zen2", "zen3", "zen4", "zen5")},  # --current
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


def test_readme_results_are_generated_from_the_current_runs():
    from dflash.bench.readme import current_kinds, stale

    kinds = current_kinds(REPO)
    assert set(kinds) == {"zen2", "zen3", "zen4", "zen5"}, kinds
    assert stale(REPO) == [], "a README results table differs from docs/results/current/: " \
                              "run python -m dflash.bench.readme --current"


def test_a_hand_edited_results_table_is_stale(tmp_path):
    """The check compares numbers: an edited cell or a re-pointed run makes it fail, and
    --current writes the table back."""
    from dflash.bench.readme import current_section, stale, write_current

    (tmp_path / "docs" / "results" / "current").mkdir(parents=True)
    for kind in ("zen4", "zen2"):
        (tmp_path / "docs" / "results" / "current" / kind).symlink_to((RESULTS / "current" / kind).resolve())
    readme = README.read_text()
    (tmp_path / "README.md").write_text(readme)
    assert stale(tmp_path) == []
    section = current_section("zen4", tmp_path / "docs/results/current/zen4/results.json")
    cell = re.search(r"\*\*[\d.]+ \([\d.]+×\)\*\*", section).group(0)
    (tmp_path / "README.md").write_text(readme.replace(cell, "**999.9 (9.99×)**", 1))
    assert stale(tmp_path) == ["zen4"]
    assert write_current(tmp_path) == ["zen2", "zen4"] and stale(tmp_path) == []
    assert (tmp_path / "README.md").read_text() == readme
    (tmp_path / "docs/results/current/zen2").unlink()
    (tmp_path / "docs/results/current/zen2").symlink_to((RESULTS / "zen2" / "done-when").resolve())
    assert stale(tmp_path) == ["zen2"]


def _index_rows() -> dict[str, str]:
    rows = {}
    for line in (RESULTS / "INDEX.md").read_text().splitlines():
        m = re.match(r"^\| \[([\w./-]+)/\]\(\1/\) \| (.+) \| (.+) \|$", line)
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} listed twice"
            rows[m.group(1)] = m.group(3)
    return rows


def _indexed_folders() -> list[str]:
    """Every folder of docs/results, one level down in the machine folders (zen2/ ...)."""
    out = []
    for d in sorted(p for p in RESULTS.iterdir() if p.is_dir() and not p.is_symlink() and p.name != "current"):
        out.append(d.name)
        if re.fullmatch(r"zen\d", d.name):
            out += [f"{d.name}/{s.name}" for s in sorted(d.iterdir()) if s.is_dir()]
    return out


def test_every_results_folder_has_an_index_line_naming_pages_that_cite_it():
    """A page cites a folder by a link into it or by naming its path."""
    rows = _index_rows()
    folders = _indexed_folders()
    assert len(folders) > 50
    assert sorted(rows) == sorted(folders), "docs/results/INDEX.md: missing " \
        f"{sorted(set(folders) - set(rows))}, stale {sorted(set(rows) - set(folders))}"
    wrong = []
    for folder, cited in rows.items():
        for target in LINK.findall(cited):
            page = Path(os.path.normpath(RESULTS / target))
            text = page.read_text()
            into = [Path(os.path.normpath(page.parent / t.split("#")[0])) for t in links(text) if is_relative(t)]
            named = re.search(rf"results/{re.escape(folder)}(/|`|\)|\s|$)", text)  # in code, as a path
            if not (named or any(p == RESULTS / folder or (RESULTS / folder) in p.parents for p in into)):
                wrong.append(f"{folder}: {target}")
    assert not wrong, f"INDEX.md names pages that do not link into the folder: {wrong}"


def test_every_script_under_results_is_listed():
    text = (RESULTS / "INDEX.md").read_text()
    scripts = sorted(p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*.py"))
    assert len(scripts) > 10
    assert not [s for s in scripts if f"]({s})" not in text], "docs/results/INDEX.md's scripts table"


def test_every_investigation_is_in_the_index():
    index = (INVESTIGATIONS / "README.md").read_text()
    pages = sorted(p.name for p in INVESTIGATIONS.glob("2*.md"))
    assert len(pages) > 10
    assert not [p for p in pages if f"]({p})" not in index], "docs/investigations/README.md"


def _module_commands() -> list[tuple[str, str]]:
    found = []
    for path in [*LINKED, REPO / "Makefile"]:
        if RESULTS in path.parents:
            continue  # the runs' own records name the modules of their day
        for m in re.finditer(r"python3? -m\s+([A-Za-z_][\w.]*)", path.read_text()):
            if not any(part.isupper() for part in m.group(1).split(".")):  # tools.NAME: a placeholder
                found.append((str(path.relative_to(REPO)), m.group(1)))
    return found


def test_every_python_module_the_docs_run_exists():
    commands = _module_commands()
    assert ("Makefile", "tools.worker_overhead") in commands
    sys.path.insert(0, str(REPO))
    try:
        missing = sorted({(page, mod) for page, mod in commands if importlib.util.find_spec(mod) is None})
    finally:
        sys.path.remove(str(REPO))
    assert not missing, f"pages run modules that do not exist: {missing}"
