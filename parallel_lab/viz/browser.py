"""Drive the Voila app in headless Chromium: what the browser tests and the latency benchmark share.

* :func:`serve_app`: Voila on a free port of 127.0.0.1, started the way ``make app`` starts it
  (:func:`parallel_lab.viz.serve.voila_argv`), ready when ``/voila/static/voila.js`` answers, stopped by
  SIGTERM (its kernels with it: Voila stops them on SIGTERM, measured with Voila 0.5).
* :func:`open_page`: a page whose requests to anything but the app are aborted and recorded
  (``page.external_requests``), JavaScript errors recorded (``page.page_errors``).
* :class:`ImageTimer`: the time from an input event (key press, click, change) to the next change of a
  chart ``<img>``'s ``src``, seen by a ``MutationObserver`` in the page: the latency a learner feels
  (the widget message to the kernel, the redraw, the PNG back over the websocket, the decode).

Chromium is Debian's ``/usr/bin/chromium``; Playwright drives it through ``executable_path`` and adds
``--headless`` itself. Playwright is imported when a function needs it.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .serve import REPO, free_port, voila_argv, voila_env

LAUNCH_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync"]
READY_TIMEOUT_S = 90


def chromium_path() -> str | None:
    """Chromium's executable, or None when it is not installed (``apt-get install chromium``)."""
    for cand in ("/usr/bin/chromium", shutil.which("chromium"), shutil.which("chromium-browser")):
        if cand and Path(cand).exists():
            return cand
    return None


class AppServer:
    """A running Voila: ``url``, ``proc``; :meth:`stop` sends SIGTERM and waits for its kernels."""

    def __init__(self, notebook: Path, log_path: Path, max_kernels: int | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        cap = {} if max_kernels is None else {"max_kernels": max_kernels}
        self.proc = subprocess.Popen(voila_argv(self.port, notebook, **cap), env=voila_env(), cwd=REPO,
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"voila exited with {self.proc.returncode}: "
                                   f"{self.log_path.read_text()[-2000:]}")
            try:
                urllib.request.urlopen(self.url + "voila/static/voila.js", timeout=1).read()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"voila did not answer within {timeout_s:.0f} s; see {self.log_path}"
                                       ) from None
                time.sleep(0.2)

    def kernels(self) -> list[Any]:
        import psutil

        return psutil.Process(self.proc.pid).children(recursive=True)

    def stop(self, timeout_s: float = 30) -> list[int]:
        """SIGTERM Voila, wait for it and its kernels; kill what is left. Returns the pids left running."""
        import psutil

        kernels = self.kernels() if self.proc.poll() is None else []
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        _, alive = psutil.wait_procs(kernels, timeout=15)
        for p in alive:
            p.kill()
        self._log.close()
        return [p.pid for p in alive]


@contextlib.contextmanager
def serve_app(notebook: Path, log_path: Path) -> Iterator[AppServer]:
    """Voila serving ``notebook``, ready; stopped on exit."""
    server = AppServer(notebook, log_path)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def launch(playwright: Any) -> Any:
    """Headless Chromium with the flags that keep it off the network."""
    path = chromium_path()
    if path is None:
        raise RuntimeError("Chromium is not installed (apt-get install chromium)")
    return playwright.chromium.launch(executable_path=path, args=LAUNCH_ARGS)


def open_page(browser: Any, url: str, *, viewport: tuple[int, int] = (1280, 1000)) -> Any:
    """A new page on ``url`` with every request not for the app aborted and recorded, page errors recorded;
    returns once the first chart is visible."""
    ctx = browser.new_context(viewport={"width": viewport[0], "height": viewport[1]})
    page = ctx.new_page()
    page.external_requests = []
    page.page_errors = []
    local = url.rstrip("/")

    def route(r: Any) -> None:
        target = r.request.url
        if target.startswith(local) or target.startswith(("data:", "blob:")):
            r.continue_()
        else:
            page.external_requests.append(target)
            r.abort()

    page.route("**/*", route)
    page.on("pageerror", lambda e: page.page_errors.append(str(e)))
    page.goto(url, wait_until="domcontentloaded", timeout=READY_TIMEOUT_S * 1000)   # the notebook runs first
    page.locator(".pl-chart:visible").first.wait_for(timeout=READY_TIMEOUT_S * 1000)
    return page


_TIMER_JS = """() => {
  if (window.__plTimer) return;
  const t = window.__plTimer = {t0: null, t1: null};
  for (const ev of ['keydown', 'mousedown', 'change'])
    document.addEventListener(ev, () => { if (t.t0 === null) t.t0 = performance.now(); }, true);
  const obs = new MutationObserver(ms => {
    for (const m of ms)
      if (m.target.classList && m.target.classList.contains('pl-chart') && t.t0 !== null && t.t1 === null)
        t.t1 = performance.now();
  });
  obs.observe(document.body, {attributes: true, attributeFilter: ['src'], subtree: true});
}"""


class ImageTimer:
    """Milliseconds from the next input event to the next ``src`` change of any ``.pl-chart`` image."""

    def __init__(self, page: Any) -> None:
        self.page = page
        page.evaluate(_TIMER_JS)

    def time(self, action: Any, timeout_s: float = 30) -> float:
        """Run ``action()`` (a key press, a click), return the milliseconds until a chart's new image."""
        self.page.evaluate("() => { window.__plTimer.t0 = null; window.__plTimer.t1 = null; }")
        action()
        self.page.wait_for_function("() => window.__plTimer.t1 !== null", timeout=timeout_s * 1000,
                                    polling=5)
        return float(self.page.evaluate("() => window.__plTimer.t1 - window.__plTimer.t0"))
