"""The docs a user navigates: every relative link in README.md and docs/ reaches a file that
exists and, with an #anchor, a heading of it (GitHub's slugs); the README stays a short way
in (at most 150 lines); docs/index.md links every page of docs/ (the results' reports
through their folder)."""
from __future__ import annotations

import glob
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_MAX_LINES = 150

LINK = re.compile(r"!?\[(?:[^\]`]|`[^`]*`)*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def pages() -> list[str]:
    docs = glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True)
    return [os.path.join(REPO, "README.md")] + sorted(docs)


def prose(text: str) -> list[str]:
    """The lines outside fenced code blocks, with inline code spans blanked."""
    out, fenced = [], False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append(re.sub(r"`[^`]*`", lambda m: "`" + "x" * (len(m.group(0)) - 2) + "`", line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    with open(path) as fh:
        text = fh.read()
    fenced = False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        m = None if fenced else HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: str) -> list[tuple[int, str]]:
    with open(path) as fh:
        text = fh.read()
    found = []
    for i, line in enumerate(prose(text), 1):
        for m in LINK.finditer(line):
            found.append((i, m.group(1)))
    return found


def broken(path: str) -> list[str]:
    wrong = []
    for line, target in links(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        file, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        where = f"{os.path.relpath(path, REPO)}:{line}: {target}"
        if not os.path.exists(dest):
            wrong.append(f"{where} (no such file)")
            continue
        if anchor and not dest.endswith(".md"):
            wrong.append(f"{where} (an anchor into a file that is not markdown)")
        elif anchor and anchor not in anchors(dest):
            wrong.append(f"{where} (no heading with that anchor)")
    return wrong


@pytest.mark.parametrize("path", pages(), ids=lambda p: os.path.relpath(p, REPO))
def test_every_relative_link_and_anchor_resolves(path):
    assert broken(path) == []


def test_the_readme_is_short():
    with open(os.path.join(REPO, "README.md")) as fh:
        assert len(fh.read().splitlines()) <= README_MAX_LINES


def test_the_index_links_every_page():
    index = os.path.join(REPO, "docs", "index.md")
    linked = {os.path.normpath(os.path.join(os.path.dirname(index), t.partition("#")[0])) for _, t in links(index)}
    results = os.path.join(REPO, "docs", "results") + os.sep  # the experiments' reports, linked as a folder
    unlinked = [os.path.relpath(p, REPO) for p in pages()[1:]
                if p != index and p not in linked and not p.startswith(results)]
    assert unlinked == []


def test_the_checker_sees_a_broken_link_and_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n\n## Two words\n\n[ok](#two-words) [bad](#three) "
                                   "[gone](b.md) `[code](c.md)`\n\n```\n[fenced](d.md)\n```\n")
    wrong = broken(str(tmp_path / "a.md"))
    assert [w.split(": ", 1)[1] for w in wrong] == ["#three (no heading with that anchor)", "b.md (no such file)"]


def test_slugs_follow_github():
    assert slug("TCP teardown (the design choice)") == "tcp-teardown-the-design-choice"
    assert slug("An operator's pins across a restart") == "an-operators-pins-across-a-restart"
    assert slug("Time-critical streams: static shunts") == "time-critical-streams-static-shunts"
    assert slug("Requests in flight (`nfshunt/openflow/inflight.py`)") == "requests-in-flight-nfshuntopenflowinflightpy"
