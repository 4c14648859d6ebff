"""mkdocs hooks of ``make docs``: the lessons and the exercise handout join the site, and nothing is fetched.

The lessons live in ``notebooks/`` and the handout in ``exercises/``, outside ``docs/``: ``on_files`` adds
them (lessons and the companion 10 as ``lessons/NN_*.ipynb``, which mkdocs-jupyter executes and renders; every file of
``exercises/`` as ``exercises/...``, the handout ``README.md`` as ``exercises/index.md``, and a page per
exercise with its statement) before the plugins see the file list. A notebook's links name ``.ipynb``
files and ``../exercises/README.md``; ``on_post_page`` points them at the rendered pages, and drops
nbconvert's MathJax, mermaid and widget loaders (CDN URLs; an explorer's place says to open the lesson in
JupyterLab), so that a built page requests nothing outside the site.
"""

from __future__ import annotations

import ast
import fnmatch
import os
import re
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

REPO = Path(__file__).resolve().parent
SKIP = ("__pycache__", ".ipynb_checkpoints", ".pytest_cache")


def on_config(config):
    """``PARALLEL_LAB_DOCS_EXECUTE`` (a glob of lesson names, default ``*``: all) says which lessons are
    executed; the others are rendered without outputs (the docs test executes one: every lesson already runs
    in ``tests/test_notebooks.py``)."""
    wanted = os.environ.get("PARALLEL_LAB_DOCS_EXECUTE", "*")
    skipped = [nb.name for nb in (REPO / "notebooks").glob("[0-9][0-9]_*.ipynb")
               if not fnmatch.fnmatch(nb.stem, wanted)]
    config.plugins["mkdocs-jupyter"].config["execute_ignore"] = skipped
    return config


@event_priority(100)          # before mkdocs-jupyter wraps the notebooks
def on_files(files: Files, config) -> Files:
    for nb in sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        files.append(File.generated(config, f"lessons/{nb.name}", abs_src_path=str(nb)))
    for path in sorted((REPO / "exercises").rglob("*")):
        if path.is_file() and not any(part in SKIP for part in path.parts) and path.suffix != ".pyc":
            rel = path.relative_to(REPO / "exercises").as_posix()
            uri = "exercises/index.md" if rel == "README.md" else f"exercises/{rel}"
            files.append(File.generated(config, uri, abs_src_path=str(path)))
    for folder in sorted(p for p in (REPO / "exercises").iterdir() if p.is_dir() and p.name not in SKIP):
        if not (folder / "README.md").exists():     # a statement in the starter's docstring: a page of its own
            files.append(File.generated(config, f"exercises/{folder.name}/index.md", content=exercise_page(folder)))
    return files


def exercise_page(folder: Path) -> str:
    """An exercise's page: its statement (the starter's docstring) and its files."""
    starter = folder / "starter.py"
    statement = ast.get_docstring(ast.parse(starter.read_text())) if starter.exists() else None
    listing = "\n".join(f"- [`{f.name}`]({f.name})" for f in sorted(folder.iterdir())
                        if f.is_file() and f.suffix != ".pyc")
    body = f"```\n{statement}\n```\n\n" if statement else ""
    return f"# Exercise `{folder.name}`\n\n{body}Files:\n\n{listing}\n\n[All exercises](../index.md)\n"


@event_priority(100)          # before mkdocs-jupyter decides whether the page is a notebook
def on_pre_page(page, config, files):
    """mkdocs-jupyter wraps a file without its ``abs_src_path`` when the file is generated (not under
    ``docs/``): give the wrapper the wrapped file's."""
    inner = getattr(page.file, "file", None)
    if inner is not None and page.file.abs_src_path is None:
        page.file.__dict__["abs_src_path"] = inner.abs_src_path
    return page


#: nbconvert's MathJax (a CDN script and its configuration; the lessons hold no formulas in TeX) and its
#: mermaid loader (a CDN module imported when a page has a diagram; the lessons have none)
_MATHJAX = re.compile(r"<!-- Load mathjax -->.*?<!-- End of mathjax configuration -->", re.S)
_MERMAID = re.compile(r'<script type="module">\s*document\.addEventListener\("DOMContentLoaded", async \(\) => \{'
                      r'\s*const diagrams = document\.querySelectorAll\("\.jp-Mermaid.*?</script>', re.S)
_NB_LINK = re.compile(r'href="((?!https?:|#)[^"]*?)\.ipynb(#[^"]*)?"')
_README_LINK = re.compile(r'href="((?!https?:)[^"]*?)README\.md(#[^"]*)?"')
#: a lesson's link to a page of docs/ (right from notebooks/ in JupyterLab): the site has that page one level up
_DOCS_LINK = re.compile(r'href="\.\./docs/([^"#]*?)\.md(#[^"]*)?"')


#: nbconvert's loader of the widget renderer (from a CDN at view time), the widgets' saved state, and a view
_WIDGET_LOADER = re.compile(r"<script>\s*\(function\(\) \{\s*function addWidgetsRenderer\(\).*?</script>", re.S)
_WIDGET_STATE = re.compile(r'<script type="application/vnd\.jupyter\.widget-state\+json">.*?</script>', re.S)
_WIDGET_VIEW = re.compile(r'<script type="application/vnd\.jupyter\.widget-view\+json">.*?</script>', re.S)
WIDGET_NOTE = ('<p class="pl-widget"><em>An explorer appears here: it needs a running kernel, so open the lesson '
               "in JupyterLab (<code>make lab</code>) or the app (<code>make app</code>).</em></p>")


def on_post_page(output: str, page, config) -> str:
    output = _MERMAID.sub("", _MATHJAX.sub("", output))
    output = _WIDGET_STATE.sub("", _WIDGET_LOADER.sub("", output))
    output = _WIDGET_VIEW.sub(WIDGET_NOTE, output)
    if page.file.src_uri.endswith(".ipynb"):
        output = _NB_LINK.sub(lambda m: f'href="{m[1]}.html{m[2] or ""}"', output)
        output = _README_LINK.sub(lambda m: f'href="{m[1]}index.html{m[2] or ""}"', output)
        output = _DOCS_LINK.sub(lambda m: f'href="../{m[1]}.html{m[2] or ""}"', output)
    return output
