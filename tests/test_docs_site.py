"""``make docs`` builds the course as a site whose internal links resolve and whose pages fetch nothing.

The build is ``mkdocs build --strict`` (mkdocs.yml, mkdocs_hooks.py) into a scratch directory, executing one
lesson (``PARALLEL_LAB_DOCS_EXECUTE``; ``tests/test_notebooks.py`` executes them all) so that the rendered
lesson is seen to carry its figures. Then, in every built page: each ``href``/``src`` that is not a web
address names a file of the site; a web address is allowed only as the ``href`` of an ``<a>`` (a link the
reader follows), never as a script, a stylesheet, a font or an image; and no stylesheet imports anything
from the web.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

REPO = Path(__file__).resolve().parents[1]
EXECUTED = "09_expert_parallel"          #: the lesson the test executes (the shortest)

pytestmark = pytest.mark.docs


class Refs(HTMLParser):
    """``(tag, attribute, value)`` of every ``href``, ``src`` and ``srcset`` of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[tuple[str, str, str]] = []
        self.in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.in_script = tag == "script"
        for name, value in attrs:
            if name in ("href", "src", "srcset", "data") and value:
                self.refs.append((tag, name, value))

    def handle_endtag(self, tag: str) -> None:
        self.in_script = False

    def handle_data(self, data: str) -> None:
        """A web address inside an inline script is something the script may load (nbconvert's widget
        loader builds a CDN ``src`` this way): counted as the script's ``src``."""
        if self.in_script:
            self.refs += [("script", "src", url) for url in re.findall(r"https?://[^\s'\"`)]+", data)]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("docs") / "site"
    env = {**os.environ, "PARALLEL_LAB_DOCS_EXECUTE": EXECUTED, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"mkdocs build failed:\n{p.stderr[-4000:]}"
    return out


@pytest.mark.timeout(600)
def test_the_site_has_every_page(site):
    for page in ["index.html", "cli.html", "validation.html", "runs.html", "cluster.html", "reshard.html",
                 "app.html", "exercises.html", "exercises/index.html", "code_map.html", "conventions.html",
                 "sources.html"]:
        assert (site / page).is_file(), f"{page} is missing from the built site"
    lessons = sorted(p.name for p in (REPO / "notebooks").glob("0*.ipynb"))
    assert lessons and all((site / "lessons" / n.replace(".ipynb", ".html")).is_file() for n in lessons)


def test_the_executed_lesson_shows_its_figures(site):
    page = (site / "lessons" / f"{EXECUTED}.html").read_text()
    assert re.search(r'<img[^>]+src="data:image/png;base64,', page), f"lesson {EXECUTED} has no figure"
    assert "Traceback" not in page


def test_internal_links_resolve_and_nothing_is_fetched(site):
    broken, fetched = [], []
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 20
    for page in pages:
        parser = Refs()
        parser.feed(page.read_text())
        for tag, attr, value in parser.refs:
            for ref in ([u.split()[0] for u in value.split(",") if u.strip()] if attr == "srcset" else [value]):
                parts = urlsplit(ref)
                if parts.scheme in ("http", "https") or ref.startswith("//"):
                    if not (tag == "a" and attr == "href"):
                        fetched.append(f"{page.relative_to(site)}: <{tag} {attr}={ref}>")
                    continue
                if parts.scheme in ("data", "mailto", "javascript") or not parts.path:
                    continue
                if parts.scheme:
                    fetched.append(f"{page.relative_to(site)}: <{tag} {attr}={ref}>")
                    continue
                base = site if parts.path.startswith("/") else page.parent   # 404.html links from the root
                target = (base / unquote(parts.path).lstrip("/")).resolve()
                if target.is_dir():
                    target = target / "index.html"
                if not target.is_file() or site.resolve() not in target.parents:
                    broken.append(f"{page.relative_to(site)}: {ref}")
    assert not broken, f"{len(broken)} internal links resolve to nothing: {broken[:20]}"
    assert not fetched, f"pages request things outside the site: {fetched[:20]}"


def test_stylesheets_import_nothing_from_the_web(site):
    bad = [f"{css.relative_to(site)}: {m[0]}" for css in site.rglob("*.css")
           for m in re.finditer(r"(?:@import\s+|url\()\s*[\"']?(?:https?:)?//[^\"')]+", css.read_text())]
    assert not bad, bad


def test_the_readme_is_one_page_whose_links_resolve():
    """The README is a first page (at most 150 lines); its links name files of the repository."""
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 150, "the README is a first page: move reference sections to docs/"
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert links
    missing = [link for link in links if not link.startswith(("http:", "https:")) and not (REPO / link).exists()]
    assert not missing, missing
