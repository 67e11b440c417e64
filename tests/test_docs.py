"""The README is the front door and docs/ holds the rest: its length, its set-up commands, and links that lead somewhere."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
README_MAX_LINES = 250
# The exact pattern .ci/run greps from README.md to find the test command it runs.
CI_TEST_LINE = re.compile(r"^pip install .* && python3 -m pytest")

# Pages other branches are writing (issue #18: the clean-room trainer against the official one). Links to them
# are allowed only while they are absent: once a page lands, its links and anchors are checked like any other.
# Remove an entry when its page is merged.
PENDING_PAGES = {DOCS / "trainer-parity.md"}

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"(?<!\\)\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+).*?\1")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced code blocks."""
    out, in_fence = [], False
    for no, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            out.append((no, line))
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").replace("*", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        slug = _slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _links(text: str) -> list[tuple[int, str]]:
    """Relative link targets of markdown text (not in code), with their line numbers."""
    out = []
    for no, line in _prose_lines(text):
        for m in LINK.finditer(INLINE_CODE.sub("", line)):
            target = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
                continue
            out.append((no, target))
    return out


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _resolve(page: Path, target: str) -> tuple[Path, str]:
    file_part, _, anchor = target.partition("#")
    return (page.parent / file_part).resolve() if file_part else page, anchor


def test_readme_is_short() -> None:
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; the front door keeps <= {README_MAX_LINES}, the rest goes to docs/"


def test_readme_keeps_the_setup_commands_ci_runs() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    ci_lines = [line for line in lines if CI_TEST_LINE.match(line)]
    assert ci_lines, ".ci/run greps README.md for '^pip install .* && python3 -m pytest' and would find nothing"
    # tools/fresh_install_check.sh runs the first ```bash block's two lines: the install + demo, then that test line.
    start = lines.index("```bash")
    end = lines.index("```", start + 1)
    block = lines[start + 1:end]
    assert len(block) == 2 and all(line.startswith("pip install ") for line in block), block
    assert block[1] == ci_lines[0], "the test command .ci/run runs must be the second line of README's first bash block"


def test_relative_links_point_to_existing_files_and_headings() -> None:
    broken = []
    for page in _pages():
        for no, target in _links(page.read_text(encoding="utf-8")):
            dest, anchor = _resolve(page, target)
            where = f"{page.relative_to(REPO)}:{no}: {target}"
            if not dest.exists():
                if dest not in PENDING_PAGES:
                    broken.append(f"{where} (no such file)")
                continue
            if anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{where} (no heading with anchor #{anchor})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_docs_page_is_reachable_from_the_readme() -> None:
    seen, todo = {README.resolve()}, [README]
    while todo:
        page = todo.pop()
        for _, target in _links(page.read_text(encoding="utf-8")):
            dest, _ = _resolve(page, target)
            if dest.suffix == ".md" and dest.exists() and dest not in seen:
                seen.add(dest)
                todo.append(dest)
    orphans = [p.name for p in DOCS.glob("*.md") if p.resolve() not in seen]
    assert not orphans, f"docs pages no link from README.md leads to: {orphans}"


def test_link_checker_sees_what_github_sees() -> None:
    # the helpers above decide the verdicts of the tests; hold them to a few known cases
    assert _slug("`store=\"gpu\"`: decoded images resident on the GPU") == "storegpu-decoded-images-resident-on-the-gpu"
    assert _slug("Ram stores and `/dev/shm` leftovers") == "ram-stores-and-devshm-leftovers"
    assert _slug("3. The decision path") == "3-the-decision-path"
    sample = "see [a](x.md#y) and `[b](not-a-link.md)` and [c](https://example.com) and [d](#here)\n```\n[e](fenced.md)\n```"
    assert [t for _, t in _links(sample)] == ["x.md#y", "#here"]
