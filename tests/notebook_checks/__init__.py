"""What each lesson must print: one module per notebook, ``<notebook stem>.py`` with ``check(text, nb)``.

``tests/test_notebooks.py`` executes every notebook once and then calls the ``check`` of its module (when
one exists) with the text of all outputs and the executed notebook. Keep the figures here the ones the
lesson computes with the library and measures on ranks, so a drifted lesson fails.
"""


def answer_checks(nb) -> int:
    """How many ``check(...)`` calls the lesson's code cells make: each renders one Feedback, so with the
    placeholder answers the text holds exactly this many "no answer yet" (one text form per output)."""
    return sum(c.source.count("check(") for c in nb.cells if c.cell_type == "code")


def assert_no_answer_everywhere(text: str, nb) -> None:
    """Every prediction cell ran with its placeholder and said so, never a silent pass, and none twice."""
    n = answer_checks(nb)
    assert n > 0, "the lesson has no check(...) cell"
    assert text.count("no answer yet") == n, (text.count("no answer yet"), n)


def markdown_of(nb) -> str:
    """The text/markdown of every output (the "What to remember" cells and other ``Markdown(...)`` results):
    the text the test passes holds one form per output, text/plain, which for a Markdown object is its repr."""
    return "\n".join(str(o.get("data", {}).get("text/markdown", "")) for c in nb.cells for o in c.get("outputs", []))
