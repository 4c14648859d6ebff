"""Serve the explorers as a web app with Voila: ``python -m parallel_lab.viz.serve [--port N]``.

``make app`` and the browser test both build their command line here, so what the test checks is what
a learner runs. Voila is started with:

* ``--Voila.ip=127.0.0.1`` and ``--Voila.port_retries=0``: local only, on exactly the port asked for;
* ``--template=parallel-lab``: Voila's lab template without its Font Awesome links to a CDN (found under
  ``notebooks/share/jupyter``, which is put on ``JUPYTER_PATH``), so the page needs no external host;
* ``--preheat_kernel=True``: a kernel runs the notebook before the first visitor arrives;
* ``--MappingKernelManager.cull_idle_timeout=120`` and ``cull_interval=30``: a closed tab's kernel is
  stopped after two idle minutes (Voila cannot shut it down itself: the request lacks an _xsrf cookie).

Code cells are hidden by Voila by default. SIGTERM stops Voila and its kernels cleanly.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
APP_NOTEBOOK = REPO / "notebooks" / "app.ipynb"
TEMPLATE_ROOT = REPO / "notebooks" / "share" / "jupyter"
TEMPLATE = "parallel-lab"
CULL_IDLE_S = 120
CULL_INTERVAL_S = 30


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def voila_argv(port: int, notebook: Path | str = APP_NOTEBOOK, *, python: str = sys.executable,
               preheat: bool = True) -> list[str]:
    """The Voila command line that serves ``notebook`` on ``127.0.0.1:port``."""
    return [
        python, "-m", "voila", str(notebook), "--no-browser",
        f"--port={port}", "--Voila.ip=127.0.0.1", "--Voila.port_retries=0",
        f"--template={TEMPLATE}", f"--preheat_kernel={preheat}",
        f"--MappingKernelManager.cull_idle_timeout={CULL_IDLE_S}",
        f"--MappingKernelManager.cull_interval={CULL_INTERVAL_S}",
    ]


def voila_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for Voila: ``JUPYTER_PATH`` extended by the app's template folder."""
    env = dict(os.environ if base is None else base)
    paths = [str(TEMPLATE_ROOT)] + [p for p in env.get("JUPYTER_PATH", "").split(os.pathsep) if p]
    env["JUPYTER_PATH"] = os.pathsep.join(paths)
    return env


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m parallel_lab.viz.serve", description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: a free one)")
    ap.add_argument("--notebook", default=str(APP_NOTEBOOK), help="notebook to serve (default: the app)")
    args = ap.parse_args(argv)
    port = args.port or free_port()
    print(f"parallel_lab app: http://127.0.0.1:{port}/   (Ctrl-C stops it)", flush=True)
    cmd = voila_argv(port, args.notebook)
    os.execve(cmd[0], cmd, voila_env())   # replace this process: Ctrl-C and SIGTERM reach Voila directly


if __name__ == "__main__":
    main()
