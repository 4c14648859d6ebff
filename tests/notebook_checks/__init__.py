"""What each lesson must print: one module per notebook, ``<notebook stem>.py`` with ``check(text, nb)``.

``tests/test_notebooks.py`` executes every notebook once and then calls the ``check`` of its module (when
one exists) with the text of all outputs and the executed notebook. Keep the figures here the ones the
lesson computes with the library and measures on ranks, so a drifted lesson fails.
"""
