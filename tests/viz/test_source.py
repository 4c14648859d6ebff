"""show_source puts the library's own lines on a lesson's page, exactly as the file has them."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from parallel_lab.distributed.data_parallel import data_parallel
from parallel_lab.viz.source import show_source


def test_the_span_is_the_files_own_lines_with_their_numbers():
    span = show_source(data_parallel.BucketedDDP, start="def _hook", stop="return")
    file_lines = Path(inspect.getsourcefile(data_parallel)).read_text().splitlines()
    assert span.path == "parallel_lab/distributed/data_parallel/data_parallel.py"
    assert "def _hook" in file_lines[span.first - 1]
    assert [ln.strip() for ln in span.lines] == [ln.strip() for ln in file_lines[span.first - 1:span.last]]
    assert span.text.startswith(f"# {span.path}, lines {span.first}-{span.last}")
    assert "<style>" in span._repr_html_() and "_hook" in span._repr_html_()


def test_a_missing_marker_or_a_long_span_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="'no such line' is not in .*data_parallel.py"):
        show_source(data_parallel, start="no such line")
    with pytest.raises(ValueError, match="over max_lines=5; narrow start/stop"):
        show_source(data_parallel.BucketedDDP, max_lines=5)
