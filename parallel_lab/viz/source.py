"""The library's own code on a lesson's page, read from the installed source so that it cannot drift.

``show_source(obj, start=..., stop=...)`` returns the lines of ``obj``'s source from the first line that
contains ``start`` to the first line after it that contains ``stop`` (both kept), with a header naming the
file and the line numbers. It refuses a span longer than ``max_lines`` (a lesson shows 15-40 lines) and a
marker it cannot find, naming the lines it searched, so a renamed function fails the lesson's test rather
than showing stale code. The result renders as highlighted code in JupyterLab, Voila and the docs site
(IPython's ``Code``) and as plain text elsewhere.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_LINES = 40


@dataclass(frozen=True)
class SourceSpan:
    """``lines`` of ``path`` (relative to the package's parent), the first being line ``first`` (1-based)."""

    path: str
    first: int
    lines: tuple[str, ...]

    @property
    def last(self) -> int:
        return self.first + len(self.lines) - 1

    @property
    def header(self) -> str:
        return f"# {self.path}, lines {self.first}-{self.last}"

    @property
    def text(self) -> str:
        return "\n".join((self.header, *self.lines))

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:                       # text/plain: the code itself, not the dataclass fields
        return self.text

    def _repr_html_(self) -> str:
        from IPython.display import Code

        html = Code(self.text, language="python")._repr_html_()
        return re.sub(r"/\*.*?\*/", "", html)          # pygments' CSS comments name token types, e.g. Traceback

    def _repr_markdown_(self) -> str:
        return f"```python\n{self.text}\n```"


def _find(lines: list[str], marker: str, begin: int, what: str, where: str) -> int:
    for i in range(begin, len(lines)):
        if marker in lines[i]:
            return i
    raise ValueError(f"{what} marker {marker!r} is not in {where}; pick a substring of one of its lines")


def source_span(obj: Any, *, start: str | None = None, stop: str | None = None,
                max_lines: int = MAX_LINES) -> SourceSpan:
    """The span of ``obj``'s source (a function, class or module) from ``start`` to ``stop`` (see module doc)."""
    lines, first = inspect.getsourcelines(obj)
    if inspect.ismodule(obj):
        first = 1
    lines = [ln.rstrip("\n") for ln in lines]
    path = Path(inspect.getsourcefile(obj) or "?")
    parts = path.parts
    rel = "/".join(parts[parts.index("parallel_lab"):]) if "parallel_lab" in parts else path.name
    where = f"{rel} lines {first}-{first + len(lines) - 1}"
    i = _find(lines, start, 0, "start", where) if start is not None else 0
    j = _find(lines, stop, i + (start is not None and stop != start), "stop", where) if stop is not None \
        else len(lines) - 1
    span = lines[i:j + 1]
    while span and not span[-1].strip():
        span.pop()
    if len(span) > max_lines:
        raise ValueError(f"{rel} lines {first + i}-{first + i + len(span) - 1} are {len(span)} lines, over "
                         f"max_lines={max_lines}; narrow start/stop or raise max_lines")
    indent = min((len(ln) - len(ln.lstrip()) for ln in span if ln.strip()), default=0)
    return SourceSpan(rel, first + i, tuple(ln[indent:] for ln in span))


def show_source(obj: Any, *, start: str | None = None, stop: str | None = None,
                max_lines: int = MAX_LINES) -> SourceSpan:
    """What a lesson cell returns to put the library's own code on the page (see :func:`source_span`)."""
    return source_span(obj, start=start, stop=stop, max_lines=max_lines)
