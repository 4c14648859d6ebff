"""Serve the explorers as a web app with Voila: ``python -m parallel_lab.viz.serve [--port N]``.

``make app`` and the browser tests both build their command line here (:func:`voila_argv`), so what the tests
check is what a learner runs: Voila on 127.0.0.1 only, on exactly the port asked for, with an offline
template (no CDN), a preheated kernel, and idle kernels culled after two minutes. Three guards Voila lacks
are installed on every handler it registers (:func:`run_voila`):

* a Host check (only 127.0.0.1, ::1 and localhost; ``--allow-remote`` behind a proxy you trust);
* one kernel per page session: a signed, HttpOnly session cookie, and every route addressed by a kernel id
  (:data:`KERNEL_ROUTES`, Voila's shutdown route included) answers only the session that owns the kernel;
* a cap on live kernels (``--max-kernels``, default :data:`MAX_KERNELS`), a slot taken before the kernel
  starts, past which the page is a short 503 that says what to do.

``main`` prints the URL once the server answers, then waits; Ctrl-C or SIGTERM stop Voila and its kernels.
Each option and guard, and why: docs/app.md.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
APP_NOTEBOOK = REPO / "notebooks" / "app.ipynb"
TEMPLATE_ROOT = REPO / "notebooks" / "share" / "jupyter"
TEMPLATE = "parallel-lab"
CULL_IDLE_S = 120
CULL_INTERVAL_S = 30
MAX_KERNELS = 8                       #: live page kernels at most (about 125 MB each)
SESSION_COOKIE = "parallel_lab_session"
LOCAL_NAMES = ("localhost",)          #: host names served besides loopback addresses
#: what marks a route addressed by a kernel id (``/voila/api/shutdown/(.*)`` names its group ``kernel_id`` not)
KERNEL_ROUTES = ("kernel_id", "/voila/api/shutdown/")
_KERNEL_ID = re.compile(r'"kernelId":\s*"([0-9a-f-]{36})"')


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def voila_argv(port: int, notebook: Path | str = APP_NOTEBOOK, *, python: str = sys.executable,
               preheat: bool = True, allow_remote: bool = False, max_kernels: int = MAX_KERNELS) -> list[str]:
    """The command line that serves ``notebook`` on ``127.0.0.1:port`` (Voila with this module's guards)."""
    ours = [f"--max-kernels={max_kernels}"] + (["--allow-remote"] if allow_remote else [])
    return [
        python, "-m", "parallel_lab.viz.serve", "--voila", *ours, "--",
        str(notebook), "--no-browser",
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


def is_local_host(host_header: str) -> bool:
    """True for ``127.0.0.1:8866``, ``[::1]:8866``, ``localhost``; False for any other name or address."""
    m = re.match(r"^(\[[^\]]*\]|[^:]*)(:\d+)?$", host_header or "")
    host = (m.group(1) if m else "").strip("[]").lower()
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host in LOCAL_NAMES


# --------------------------------------------------------------------------------------------------
# The guards, installed in the Voila process
# --------------------------------------------------------------------------------------------------

class Guard:
    """Which page session owns which kernel, and the limits (one per server process)."""

    def __init__(self, max_kernels: int, allow_remote: bool):
        self.max_kernels, self.allow_remote = max_kernels, allow_remote
        self.owner: dict[str, str] = {}          # kernel id -> session token
        self.starting = 0                        # pages that hold a slot and have no kernel id yet

    def live(self, kernel_manager: Any) -> int:
        """Page kernels alive, plus the slots of pages still starting theirs."""
        alive = set(kernel_manager.list_kernel_ids())
        for k in [k for k in self.owner if k not in alive]:
            del self.owner[k]
        return len(self.owner) + self.starting

    def take_slot(self, kernel_manager: Any) -> int | None:
        """A slot for one more page kernel, taken before any ``await`` (so atomic on Tornado's one thread);
        None when the cap is reached. The count of live kernels and slots is returned either way."""
        live = self.live(kernel_manager)
        if live >= self.max_kernels:
            return None
        self.starting += 1
        return live + 1


FULL_PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>parallel_lab: the app is full</title></head>
<body style="font-family: sans-serif; max-width: 40em; margin: 4em auto">
<h1>The app is full</h1>
<p>{live} pages are open, each with its own kernel (about 125 MB), and this server allows {cap}.</p>
<p>Close a tab you no longer use and reload this page in two minutes (idle kernels are stopped after
{idle} s), or restart the app with a larger <code>--max-kernels</code>.</p></body></html>"""


def _guarded(cls: type, guard: Guard, owned: bool) -> type:
    """``cls`` with the Host check (and, for handlers addressed by a kernel id, the owner check)."""
    from tornado import web

    class Guarded(cls):  # type: ignore[misc, valid-type]
        def prepare(self, *args: Any, **kwargs: Any) -> Any:
            if not guard.allow_remote and not is_local_host(self.request.host):
                raise web.HTTPError(403, f"Host {self.request.host[:80]!r} is not served; this app answers "
                                         f"127.0.0.1 and localhost only (start it with --allow-remote)")
            if owned:                  # the kernel's REST handler, websocket, Voila's shutdown and query
                kernel_id = self.path_kwargs.get("kernel_id") or (self.path_args[0] if self.path_args else "")
                token = self.get_secure_cookie(SESSION_COOKIE)
                if token is None or guard.owner.get(str(kernel_id)) != token.decode():
                    raise web.HTTPError(403, "this kernel belongs to another page session")
            return super().prepare(*args, **kwargs)

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{cls.__name__}"
    return Guarded


def _page(cls: type, guard: Guard) -> type:
    """The notebook page: a session cookie, the kernel cap, and the record of the kernel it starts."""
    from tornado import web

    base = _guarded(cls, guard, owned=False)

    class Page(base):  # type: ignore[misc, valid-type]
        @web.authenticated
        async def get(self, path: Any = None) -> None:
            if guard.take_slot(self.kernel_manager) is None:
                self.set_status(503)
                self.set_header("Content-Type", "text/html")
                self.set_header("Retry-After", str(CULL_IDLE_S))
                self.finish(FULL_PAGE.format(live=guard.live(self.kernel_manager), cap=guard.max_kernels,
                                             idle=CULL_IDLE_S))
                return
            self.slot = True
            try:
                token = self.get_secure_cookie(SESSION_COOKIE)
                self.session = token.decode() if token else secrets.token_urlsafe(24)
                if token is None:
                    self.set_secure_cookie(SESSION_COOKIE, self.session, httponly=True, samesite="Strict")
                await super().get(path)
            finally:
                self._release()

        def _release(self) -> None:
            if getattr(self, "slot", False):
                guard.starting -= 1
                self.slot = False

        async def get_generator(self, path: Any = None) -> Any:
            found = False
            async for html in super().get_generator(path=path):
                if not found and (m := _KERNEL_ID.search(html)):
                    guard.owner[m.group(1)] = self.session      # before the browser can know the id
                    self._release()                             # the slot is now the kernel's entry
                    found = True
                yield html

    Page.__name__ = Page.__qualname__ = f"Page{cls.__name__}"
    return Page


def run_voila(argv: list[str]) -> None:
    """Voila, in this process, with the guards on every handler (``argv``: ours, ``--``, Voila's)."""
    ap = argparse.ArgumentParser(prog="parallel_lab.viz.serve --voila")
    ap.add_argument("--max-kernels", type=int, default=MAX_KERNELS)
    ap.add_argument("--allow-remote", action="store_true")
    split = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:split])
    voila_args = argv[split + 1:]

    from voila.app import Voila
    from voila.handler import VoilaHandler

    guard = Guard(max(1, args.max_kernels), args.allow_remote)
    original = Voila.init_handlers

    def init_handlers(self: Any) -> list:
        out = []
        for spec in original(self):
            pattern, cls, *rest = spec
            if isinstance(cls, type) and issubclass(cls, VoilaHandler):
                cls = _page(cls, guard)
            elif isinstance(cls, type) and hasattr(cls, "prepare"):
                cls = _guarded(cls, guard, owned=any(k in str(pattern) for k in KERNEL_ROUTES))
            out.append((pattern, cls, *rest))
        return out

    Voila.init_handlers = init_handlers  # type: ignore[method-assign]
    Voila.launch_instance(argv=voila_args,
                          tornado_settings={"allow_remote_access": args.allow_remote,
                                            "local_hostnames": list(LOCAL_NAMES)})


# --------------------------------------------------------------------------------------------------
# ``make app``
# --------------------------------------------------------------------------------------------------

def wait_until_up(url: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> bool:
    """Poll ``url`` until it answers (True) or the process ends or the time is up (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError):
            urllib.request.urlopen(url, timeout=2).read()
            return True
        time.sleep(0.2)
    return False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--voila"]:
        run_voila(argv[1:])
        return 0
    ap = argparse.ArgumentParser(prog="python -m parallel_lab.viz.serve", description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: a free one)")
    ap.add_argument("--notebook", default=str(APP_NOTEBOOK), help="notebook to serve (default: the app)")
    ap.add_argument("--max-kernels", type=int, default=MAX_KERNELS,
                    help=f"live page kernels at most, ~125 MB each (default {MAX_KERNELS})")
    ap.add_argument("--allow-remote", action="store_true",
                    help="serve requests whatever their Host header (default: 127.0.0.1 and localhost only)")
    args = ap.parse_args(argv)
    port = args.port or free_port()
    cmd = voila_argv(port, args.notebook, allow_remote=args.allow_remote, max_kernels=args.max_kernels)
    proc = subprocess.Popen(cmd, env=voila_env())
    signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
    url = f"http://127.0.0.1:{port}/"
    try:
        if wait_until_up(url + "voila/static/voila.js", proc):
            print(f"parallel_lab app: {url}   (Ctrl-C stops it)", flush=True)
        elif proc.poll() is None:
            print(f"parallel_lab app: the server did not answer at {url} within 120 s; still waiting",
                  flush=True)
        return proc.wait()
    except KeyboardInterrupt:             # Ctrl-C reached Voila too (same process group); let it finish
        try:
            return proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            return 130


if __name__ == "__main__":
    sys.exit(main())
