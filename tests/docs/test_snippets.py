"""Every Python block of README.md and docs/**/*.md runs as written; the Markdown parses as it reads.

Conventions for the blocks (writers of README.md and docs/ follow them):

* Every fenced block whose info string is ``python`` runs, on the 8-device CPU mesh that
  ``tests/conftest.py`` sets up, with a fresh temporary directory as the working directory.
* The blocks of one file run in order in one namespace, as a reader would type them into one
  interpreter: a later block may use the names an earlier one defined (``engine``, ``cfg``...).
  Different files share nothing.
* A block that cannot run here (it needs a GPU, several hosts, a download) carries a marker on the
  line directly before its opening fence: ``<!-- notest: <reason> -->``; the reason is required.
  Nothing else skips a block.
* A ``text`` block with ``<!-- output -->`` on the line directly before its opening fence is what the python
  block before it prints: the block's standard output must equal it (line by line, trailing spaces aside).
  Print only what is the same on every run (rounded losses, the build summary), never times or rates.
* Blocks stay small: tiny models, one or two steps. The whole of ``tests/docs`` stays under 90 s.

Markdown checks (CommonMark, parsed with markdown-it-py): every fence closes where its writer meant
it to (a closing fence has nothing after it), so no heading ends up inside a code block.
"""
from __future__ import annotations

import contextlib
import gc
import io
import pathlib
import re
import textwrap

import pytest
from markdown_it import MarkdownIt

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEST = re.compile(r"^<!-- notest: (\S.*?) -->$")
OUTPUT = "<!-- output -->"
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
HEADING = re.compile(r"^ {0,3}#{1,6}(\s|$)")


def markdown_files() -> list[pathlib.Path]:
    files = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
    return [f for f in files if "_build" not in f.parts and f.exists()]


def _rel(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def blocks(path: pathlib.Path) -> list[tuple[int, str, str | None]]:
    """``(line, code, skip reason or None)`` of every ``python`` fence, in order (line: 1-based, the fence's)."""
    text = path.read_text()
    lines = text.splitlines()
    out = []
    for tok in MarkdownIt("commonmark").parse(text):
        if tok.type != "fence" or tok.info.strip().split(" ")[0] != "python":
            continue
        start = tok.map[0]
        before = lines[start - 1].strip() if start > 0 else ""
        m = NOTEST.match(before)
        if before.startswith("<!-- notest") and not m:
            raise AssertionError(f"{_rel(path)}:{start}: a skip marker is '<!-- notest: <reason> -->'")
        out.append((start + 1, tok.content, m.group(1) if m else None))
    return out


def outputs(path: pathlib.Path) -> dict[int, str]:
    """``{line of a python block: the output it prints}`` from the ``text`` blocks marked ``<!-- output -->``."""
    text = path.read_text()
    lines = text.splitlines()
    out, last = {}, None
    for tok in MarkdownIt("commonmark").parse(text):
        if tok.type != "fence":
            continue
        kind, start = tok.info.strip().split(" ")[0], tok.map[0]
        if kind == "python":
            last = start + 1
        elif start > 0 and lines[start - 1].strip() == OUTPUT:
            if kind != "text" or last is None or last in out:
                raise AssertionError(f"{_rel(path)}:{start}: an output block is a text block after the python "
                                     "block that prints it (one per python block)")
            out[last] = tok.content
    return out


def _same_output(got: str, want: str) -> bool:
    def norm(t: str) -> list[str]:
        return [l.rstrip() for l in t.strip("\n").splitlines()]
    return norm(got) == norm(want)


FILES = markdown_files()


@pytest.mark.parametrize("path", FILES, ids=_rel)
def test_python_blocks_run(path, tmp_path, monkeypatch):
    runnable = [(line, code) for line, code, skip in blocks(path) if skip is None]
    if not runnable:
        pytest.skip("no runnable python block")
    expected = outputs(path)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    try:
        for line, code in runnable:
            printed = io.StringIO()
            try:
                with contextlib.redirect_stdout(printed) if line in expected else contextlib.nullcontext():
                    exec(compile(textwrap.dedent(code), f"{_rel(path)}:{line}", "exec"), namespace)
            except Exception as e:
                raise AssertionError(f"the python block at {_rel(path)}:{line} fails: "
                                     f"{type(e).__name__}: {e}") from e
            if line in expected:
                assert _same_output(printed.getvalue(), expected[line]), (
                    f"the python block at {_rel(path)}:{line} prints\n{printed.getvalue()}\nnot the output the "
                    f"page shows after it:\n{expected[line]}")
    finally:
        for value in list(namespace.values()):  # engines left open by a failing block
            if type(value).__name__ == "Engine":
                try:
                    value.close()
                except Exception:
                    pass
        namespace.clear()
        gc.collect()


def intended(lines: list[str]) -> tuple[set[tuple[int, int]], set[int]]:
    """The fences and headings as a writer means them: a fence line opens or closes, whatever follows it."""
    fences, headings, opened = set(), set(), None
    for i, line in enumerate(lines):
        m = FENCE.match(line)
        if m and opened is None:
            opened = (i, m.group(1)[0])
        elif m and line.strip()[0] == opened[1]:
            fences.add((opened[0], i + 1))
            opened = None
        elif opened is None and HEADING.match(line):
            headings.add(i)
    return fences, headings


@pytest.mark.parametrize("path", FILES, ids=_rel)
def test_commonmark_reads_as_written(path):
    text = path.read_text()
    lines = text.splitlines()
    tokens = MarkdownIt("commonmark").parse(text)
    parsed_fences = {tuple(t.map) for t in tokens if t.type == "fence"}
    headings = {t.map[0] for t in tokens if t.type == "heading_open"}
    want_fences, want_headings = intended(lines)
    bad = sorted(want_fences - parsed_fences)
    assert not bad, "fences CommonMark does not close where they seem to (text after a closing fence?): " + \
        ", ".join(f"{_rel(path)}:{a + 1}-{b}" for a, b in bad)
    inside = sorted(want_headings - headings)
    assert not inside, "headings that CommonMark reads as code or text: " + \
        ", ".join(f"{_rel(path)}:{i + 1} {lines[i]!r}" for i in inside)


def test_the_checks_catch_a_heading_swallowed_by_a_fence(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n```python\nx = 1\n``` and text after the fence\n\n## Next section\n\nprose\n")
    lines = page.read_text().splitlines()
    tokens = MarkdownIt("commonmark").parse(page.read_text())
    want_fences, want_headings = intended(lines)
    assert want_headings - {t.map[0] for t in tokens if t.type == "heading_open"} == {6}
    assert want_fences - {tuple(t.map) for t in tokens if t.type == "fence"}


def test_skip_markers_need_a_reason(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- notest: needs a GPU -->\n```python\nimport cupy\n```\n\n```python\nx = 1\n```\n")
    assert [(code, skip) for _, code, skip in blocks(page)] == [("import cupy\n", "needs a GPU"), ("x = 1\n", None)]
    page.write_text("<!-- notest -->\n```python\nx = 1\n```\n")
    with pytest.raises(AssertionError, match="reason"):
        blocks(page)


def test_an_output_block_is_what_its_python_block_prints(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```python\nprint(1 + 1)\n```\n\n<!-- output -->\n```text\n2\n```\n\n```python\nx = 1\n```\n")
    assert outputs(page) == {1: "2\n"}
    assert _same_output("2  \n", "2\n") and not _same_output("3\n", "2\n")
    page.write_text("<!-- output -->\n```text\n2\n```\n")
    with pytest.raises(AssertionError, match="after the python block"):
        outputs(page)
