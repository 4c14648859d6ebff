"""Graded exercises: inline feedback for notebooks and a grader for submissions, distributed code included.

Inline feedback (stable signature; pure Python, importing it never imports torch)::

    from parallel_lab.grading.feedback import check
    fb = check(answer, expected, *, rtol=None, atol=0.0, terms=None, name="your answer", unit="", reveal=None)

``expected`` is a number, or a mapping ``{term: value}`` whose values add up to the total; ``terms`` names
the parts of a numeric ``expected``. ``fb`` is a :class:`Feedback`: truthy when right; its ``message`` says
"right", or a hint (a missed term, a term counted twice, a unit slip such as GB vs GiB, or the direction);
the expected value and the relative error from the second wrong try (or ``reveal=True``; graders' tests use
``check_revealed``); ``fb.missed`` lists the terms left out. A missing answer (``None`` or
``...``) is never a pass. In a notebook the returned object displays itself.
``check_hash(answer, digest, salt)`` checks a number against a salted hash (``answer_hash``), so that an
exercise can ship a per-learner answer (``learner_params``) without shipping the number.

The grader (``parallel-lab grade EXERCISE [PATH]``, ``--batch DIR --out grades.csv``) lives in
:mod:`parallel_lab.grading.runner`; exercises live in ``exercises/`` (statements, starters, public tests);
reference solutions, mutants and hidden tests live in an instructor bundle outside the package.
"""
