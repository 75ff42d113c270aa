"""The docs' links resolve: every relative link and ``#anchor`` in the repository's Markdown pages
points at a file of the repository and a heading it has, and no page names a file outside it.

Anchors follow GitHub's slug rules: the heading's text lowercased, every character but letters,
digits, spaces, ``-`` and ``_`` dropped, spaces turned into ``-``; a repeated slug gets ``-1``,
``-2``, … in document order. Links inside fenced code blocks and inline code are not links.
No network: ``http(s)://`` and ``mailto:`` links are not fetched.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = (
    "README.md",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
    "bench/README.md",
    "bench/EMULATED.md",
    "tests/README.md",
    "deploy/README.md",
    "tests/chaos/README.md",
)
"""Every page whose links are checked (paths relative to the repository root)."""

LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
"""An inline Markdown link ``[text](target "title")``; group 1 is the target."""

FORBIDDEN = (
    (re.compile(r"\.\./shared\b"), "a folder outside the repository (../shared)"),
    (re.compile(r"(?<![\w.])/work/"), "an absolute path of one machine (/work/...)"),
    (re.compile(r"DESIGN\.md|DESIGN section|DESIGN §"), "DESIGN.md, which is not in the repository"),
)
"""Text no page may contain, and why."""


def strip_code(text: str, inline: bool = True) -> str:
    """``text`` with fenced code blocks (and inline code spans, unless ``inline`` is False) blanked,
    line count kept."""
    out, fenced = [], False
    for line in text.splitlines():
        if re.match(r"^\s*(```|~~~)", line):
            fenced = not fenced
            out.append("")
            continue
        out.append("" if fenced else re.sub(r"(`+)(?:(?!\1).)+?\1", "", line) if inline else line)
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (before de-duplication)."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading keeps its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of ``page``, with GitHub's ``-1``, ``-2`` suffixes for repeats."""
    seen: Counter[str] = Counter()
    found = set()
    for line in strip_code(page.read_text(), inline=False).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        found.add(base if seen[base] == 0 else f"{base}-{seen[base]}")
        seen[base] += 1
    for name in re.findall(r'<a\s+(?:name|id)="([^"]+)"', page.read_text()):
        found.add(name)
    return found


def links(page: Path) -> list[tuple[int, str]]:
    """(line number, target) of every inline link of ``page`` outside code."""
    found = []
    for number, line in enumerate(strip_code(page.read_text()).splitlines(), 1):
        found += [(number, m.group(1)) for m in LINK.finditer(line)]
    return found


def broken(page_name: str) -> list[str]:
    """What is wrong with the links of one page, one line per problem."""
    page = ROOT / page_name
    problems = []
    for number, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        where = f"{page_name}:{number}: {target}"
        if ROOT not in dest.parents and dest != ROOT:
            problems.append(f"{where}: outside the repository")
        elif not dest.exists():
            problems.append(f"{where}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: no heading #{anchor} in {dest.relative_to(ROOT)}")
        elif anchor and dest.suffix != ".md":
            problems.append(f"{where}: an anchor into a file that is not Markdown")
    text = page.read_text()
    for pattern, why in FORBIDDEN:
        for m in pattern.finditer(text):
            problems.append(f"{page_name}:{text.count(chr(10), 0, m.start()) + 1}: names {why}")
    return problems


def test_slugs_follow_githubs_rules() -> None:
    assert slug("5. The consistency engine") == "5-the-consistency-engine"
    assert slug("A push's identity and the error contract") == "a-pushs-identity-and-the-error-contract"
    assert slug("Without a registry: `deploy/local-engine.sh`") == "without-a-registry-deploylocal-enginesh"
    assert slug("The finished model: `ps-admin export`") == "the-finished-model-ps-admin-export"
    assert slug("Faults survived, bad input refused") == "faults-survived-bad-input-refused"


def test_repeated_headings_get_numbered_anchors(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("# Setup\n\n## Setup\n\n```\n# Setup\n```\n\n### Setup\n")
    assert anchors(page) == {"setup", "setup-1", "setup-2"}


def test_links_in_code_are_not_links(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("[a](b.md) `[c](d.md)`\n```\n[e](f.md)\n```\n[g](h.md#i)\n")
    assert [t for _, t in links(page)] == ["b.md", "h.md#i"]


@pytest.mark.parametrize("page", PAGES)
def test_every_link_and_anchor_resolves(page: str) -> None:
    assert (ROOT / page).exists(), f"{page} is listed in PAGES but does not exist"
    problems = broken(page)
    assert not problems, "\n".join(problems)


def test_every_markdown_page_of_docs_is_checked() -> None:
    pages = {str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")}
    assert pages <= set(PAGES)


def test_the_code_cites_anchors_the_docs_have() -> None:
    """Every ``docs/<page>.md#<anchor>`` a docstring or comment cites is a heading of that page."""
    cited = re.compile(r"\b(docs/[\w-]+\.md)#([\w-]+)")
    problems = []
    for source in sorted(ROOT.glob("*/**/*.py")):
        if any(part.startswith(".") or part in ("ps_proto", "node_modules") for part in source.parts):
            continue
        for number, line in enumerate(source.read_text(errors="replace").splitlines(), 1):
            for page, anchor in cited.findall(line):
                target = ROOT / page
                if not target.exists() or anchor not in anchors(target):
                    problems.append(f"{source.relative_to(ROOT)}:{number}: {page}#{anchor}")
    assert not problems, "no such page or heading:\n" + "\n".join(problems)
