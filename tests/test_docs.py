"""The README and the documentation pages refer to other pages and sections by links, never by a bare title.

A plain-text reference such as "see Reliability", "see "Input pipelines" below" or "(below)" names a section
that a reader cannot click and that MkDocs cannot check: it survives a page being renamed or split and then
leads nowhere. A reference to another page or section is a Markdown link (``[Faults](faults.md)``,
``[Slow links](machines.md#slow-links)``), which ``mkdocs build --strict`` checks; README's links to
``docs/...md`` are checked here. Pure text: no Keras, no processes.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[ \t]*$", re.M | re.S)
CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[([^\]]*)\]\([^)\s]*(?:\s+\"[^\"]*\")?\)")

# What a plain-text reference looks like, once links, code and line breaks are out of the way.
DANGLING = {
    # "see Reliability", "(see Launching)", "See Input pipelines": "see" then a capitalised word or a quoted title
    # (a link, "see [Faults](...)", starts with a bracket and is fine; so is "see `x`").
    "see <Title>": re.compile(r"\b[Ss]ee\s+(?:[A-Z][\w-]*|[\"“'‘][^\"”'’]{1,60}[\"”'’])"),
    # "(below)", "(above)", "(see below)": a pointer to a place on the page, named by nothing.
    "(below)": re.compile(r"\((?:see\s+)?(?:below|above)\)", re.I),
    # '"Input pipelines" below', "'Backends' above": a section named by its title in quotes.
    "\"<Title>\" below": re.compile(r"(?<!\w)[\"“'‘][A-Z][^\"”'’]{0,60}[\"”'’]\s+(?:below|above)\b"),
}


def prose(markdown: str) -> str:
    """The page's running text: fenced code blocks and inline code dropped, each link reduced to ``[text]``,
    whitespace (line breaks too, since a reference can wrap) collapsed to one space."""
    text = FENCE.sub(" ", markdown)
    text = CODE.sub("`code`", text)
    text = LINK.sub(lambda m: f"[{m.group(1)}]", text)
    return re.sub(r"\s+", " ", text)


def dangling(markdown: str) -> list[str]:
    """Each plain-text reference in ``markdown``, as ``kind: ...context...``."""
    text = prose(markdown)
    found = []
    for kind, pattern in DANGLING.items():
        for m in pattern.finditer(text):
            found.append(f"{kind}: ...{text[max(0, m.start() - 40):m.end() + 20]}...")
    return found


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_no_plain_text_references(page):
    assert dangling(page.read_text()) == []


@pytest.mark.parametrize("phrase", [
    "naming the rank, its device and the cause (see Launching). An error",
    "| yes, on torch (`min_devices=`; see Reliability) |",
    "a hang (see\n  Reliability; over gloo or NCCL, a check",
    'on torch and JAX: see "Input\n  pipelines" below. `batch_size` is ignored',
    'the backward pass (see "What is exact, and how").',
    'backends work too (see "On JAX" and "Backends" below):',
    "the sums start **during the\n  backward pass** (below).",
    "`multigpu calibrate` finds the limits (below).",
    "See Troubleshooting for more.",
])
def test_the_old_phrases_are_caught(phrase):
    assert dangling(phrase), phrase


@pytest.mark.parametrize("phrase", [
    "the cause ([When a rank fails](machines.md#when-a-rank-fails)).",
    "see [Input pipelines](inputs.md). `batch_size` is ignored",
    "(see [Troubleshooting](guides/troubleshooting.md))",
    "Keras's own default is TensorFlow, as the quickstart below does in its first lines.",
    "the messages below are the ones users meet most",
    "running out costs one step taken again (as described next)",
    "`see Reliability` inside code, and\n```text\nsee Launching (below)\n```\n",
    "Keras's own `fit` loop; the model's 'train_step' runs",
])
def test_links_and_ordinary_prose_pass(phrase):
    assert dangling(phrase) == [], phrase


def test_readme_links_lead_somewhere():
    """README's relative links (to ``docs/...md``, ``CONTRIBUTING.md``, ...) name files of the checkout."""
    text = FENCE.sub(" ", (ROOT / "README.md").read_text())
    targets = [m.group(1) for m in re.finditer(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", text)]
    missing = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert missing == []
