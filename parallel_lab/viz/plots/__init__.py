"""Pictures of the lab's numbers: pure functions from plain data to a matplotlib ``Figure``.

Every function takes data (a memory ledger, a communication report, a timeline, a planner result), as the
library's objects or as the dictionaries ``parallel-lab ... --json`` prints, and returns a
:class:`matplotlib.figure.Figure` (``*_figure``) or draws into a given ``Axes`` (``draw_*``). Nothing here
touches widgets or pyplot's global state, so the same pictures serve notebooks, the Voila app and the
tests (which read the bars' heights back).

One module per topic: :mod:`.base` (colours, units, round axis ends, charts that update in place),
:mod:`.memory`, :mod:`.comm`, :mod:`.timeline`, :mod:`.planner`; each name is imported from its module
(``from parallel_lab.viz.plots.memory import memory_figure``).

Units: GB means 10**9 bytes (``docs/conventions.md``); every label picks the unit that suits its value
(``quantities.fmt_bytes``, ``quantities.fmt_seconds``).
"""
