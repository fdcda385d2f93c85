"""MkDocs hook: the reference pages' generated parts, taken from the code at every build.

``<!-- multigpu:cli -->`` becomes every command's ``--help`` (from the
parsers of :mod:`multigpu.cli.main`), ``<!-- multigpu:env -->`` the
documentation of :mod:`multigpu.env`, so neither can drift from the code.
"""

from __future__ import annotations

import contextlib
import io
import re


def _cli() -> str:
    from multigpu.cli.main import _COMMANDS, build_parser

    parts = []
    for name in ("", *_COMMANDS):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            build_parser().parse_args([*([name] if name else []), "--help"])
        parts.append(f"## `multigpu{' ' + name if name else ''}`\n\n```text\n{out.getvalue().strip()}\n```\n")
    return "\n".join(parts)


def _env() -> str:
    from multigpu import env

    return re.sub(r":(?:func|mod|class|meth):`([^`]+)`", r"``\1``", env.__doc__.strip())


def on_page_markdown(markdown: str, **kwargs) -> str:
    if "<!-- multigpu:cli -->" in markdown:
        markdown = markdown.replace("<!-- multigpu:cli -->", _cli())
    if "<!-- multigpu:env -->" in markdown:
        markdown = markdown.replace("<!-- multigpu:env -->", _env())
    return markdown
