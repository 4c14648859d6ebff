"""What every ``parallel-lab`` subcommand is made of: a handler returning :class:`Output`, registered with
:func:`subcommand` (which gives it ``--json``).

``cli.py`` assembles the subcommands; modules that add their own (``grading/cli.py``) import these two names
from here, so that no module imports ``cli`` back (no import cycle).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Output:
    """What a handler returns: ``data`` is printed for ``--json``, ``text`` otherwise."""

    data: dict[str, Any]
    text: str


def add_json_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def subcommand(sub: Any, name: str, handler: Callable[[argparse.Namespace], Output], help: str,
               description: str | None = None) -> argparse.ArgumentParser:
    """Create subcommand ``name`` running ``handler``; it always has ``--json``."""
    p = sub.add_parser(name, help=help, description=description or help)
    add_json_arg(p)
    p.set_defaults(handler=handler)
    return p
