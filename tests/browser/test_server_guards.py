"""The app server's guards (issue 18), against the real server in headless Chromium.

One server for the module, started the way ``make app`` starts it (:func:`serve.voila_argv`) with
``max_kernels=2``. A request with a foreign ``Host`` (the shape of DNS rebinding: the attacker's name
resolving to 127.0.0.1) is refused, page, static files and kernel websocket alike; a second browser
session that knows the first one's kernel id can neither reach its REST handler nor open its websocket,
while the first session's own page works; past the kernel cap the page is a clear 503. A second server (a
one-cell notebook, cap 8) checks issue 36: Voila's shutdown route refuses another session even with a
matching ``_xsrf`` pair, and 16 concurrent loads start 8 kernels, the other 8 get the 503.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request

import pytest
from test_app import ARTIFACTS, psutil, sync_api  # noqa: F401 (skips as test_app does)

from parallel_lab.viz.browser import LAUNCH_ARGS, chromium_path
from parallel_lab.viz.serve import APP_NOTEBOOK, REPO, SESSION_COOKIE, free_port, voila_argv, voila_env

CHROMIUM = chromium_path()

pytestmark = pytest.mark.browser
CAP = 2


def _serve(log_name: str, notebook=None, **kw):
    """A server started as ``make app`` starts it (``voila_argv``); yields ``(port, process)``, then stops it."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = open(ARTIFACTS / log_name, "w")  # noqa: SIM115 - closed at teardown
    proc = subprocess.Popen(voila_argv(port, notebook or APP_NOTEBOOK, **kw), env=voila_env(), cwd=REPO,
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            log.close()
            pytest.fail(f"the server exited with {proc.returncode}: {(ARTIFACTS / log_name).read_text()[-2000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/voila/static/voila.js", timeout=2).read()
            break
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail("the server did not answer within 120 s")
            time.sleep(0.3)
    yield port, proc
    kernels = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    finally:
        _, alive = psutil.wait_procs(kernels, timeout=15)
        for p in alive:
            p.kill()
        log.close()


@pytest.fixture(scope="module")
def server():
    for port, _ in _serve("voila-guards.log", max_kernels=CAP):
        yield port


def status(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", path, headers=headers or {})
    r = conn.getresponse()
    body = r.read().decode(errors="replace")
    conn.close()
    return r.status, body


WS = {"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
      "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}


def test_a_foreign_host_is_refused(server):
    port = server
    evil = {"Host": f"rebind.example:{port}", "Origin": f"http://rebind.example:{port}"}
    assert status(port, "/", evil)[0] == 403                                 # no page, so no kernel
    assert status(port, "/voila/static/voila.js", evil)[0] == 403
    fake_id = "00000000-0000-4000-8000-000000000000"
    assert status(port, f"/api/kernels/{fake_id}/channels", {**evil, **WS})[0] == 403
    assert status(port, "/voila/static/voila.js", {"Host": f"localhost:{port}"})[0] == 200
    assert status(port, "/voila/static/voila.js")[0] == 200                  # Host 127.0.0.1:port


def test_another_session_cannot_reach_a_kernel_and_the_cap_holds(server):
    port = server
    url = f"http://127.0.0.1:{port}/"
    external: list[str] = []

    def route(r):
        if r.request.url.startswith(f"http://127.0.0.1:{port}") or r.request.url.startswith(f"ws://127.0.0.1:{port}"):
            r.continue_()
        else:
            external.append(r.request.url)
            r.abort()

    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        try:
            a = browser.new_context(viewport={"width": 1280, "height": 1000}).new_page()
            a.route("**/*", route)
            a.goto(url, wait_until="domcontentloaded", timeout=120_000)
            a.locator(".pl-chart:visible").first.wait_for(timeout=120_000)   # A's own kernel works
            kernel_a = re.search(r'"kernelId":\s*"([0-9a-f-]{36})"', a.content()).group(1)
            assert a.evaluate(f"fetch('/api/kernels/{kernel_a}').then(r => r.status)") == 200

            b = browser.new_context().new_page()                           # a second session (no cookies)
            b.route("**/*", route)
            b.goto(url, wait_until="domcontentloaded", timeout=120_000)
            b.locator(".pl-chart:visible").first.wait_for(timeout=120_000)
            assert b.evaluate(f"fetch('/api/kernels/{kernel_a}').then(r => r.status)") == 403
            assert b.evaluate(f"fetch('/voila/api/shutdown/{kernel_a}', {{method: 'POST'}}).then(r => r.status)") \
                == 403
            opened = b.evaluate(f"""() => new Promise(done => {{
                const ws = new WebSocket('ws://127.0.0.1:{port}/api/kernels/{kernel_a}/channels');
                ws.onopen = () => {{ ws.close(); done('open'); }};
                ws.onerror = () => done('refused');
                setTimeout(() => done('timeout'), 20000);
            }})""")
            assert opened == "refused"
            # A still works after B's attempts: its kernel was neither reached nor shut down
            assert a.evaluate(f"fetch('/api/kernels/{kernel_a}').then(r => r.status)") == 200
            b.screenshot(path=str(ARTIFACTS / "server-second-session.png"))

            code, body = status(port, "/")                                 # a third page: over the cap
            assert code == 503 and "The app is full" in body and f"this server allows {CAP}" in body
            c = browser.new_context().new_page()
            c.goto(url, wait_until="domcontentloaded", timeout=120_000)
            assert "The app is full" in c.content()
            c.screenshot(path=str(ARTIFACTS / "server-full.png"))
        finally:
            browser.close()
    assert external == []


# --------------------------------------------------------------------------------------------------
# Issue 36: Voila's shutdown route, and the cap under concurrent loads (a one-cell notebook, no preheat)
# --------------------------------------------------------------------------------------------------

BIG_CAP = 8
XSRF = "0123456789abcdef0123456789abcdef"          # any _xsrf cookie, and the same value in X-XSRFToken


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    nb = tmp_path_factory.mktemp("nb") / "one_cell.ipynb"
    nb.write_text(json.dumps({"cells": [{"cell_type": "code", "execution_count": None, "id": "c1", "metadata": {},
                                         "outputs": [], "source": ["x = 1"]}],
                              "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python",
                                                          "name": "python3"}},
                              "nbformat": 4, "nbformat_minor": 5}))
    yield from _serve("voila-cap.log", nb, max_kernels=BIG_CAP, preheat=False)


def load(port: int, cookie: str = "") -> tuple[int, str, str]:
    """GET the page: status, the kernel id it started ('' if none), and its session cookie."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=180)
    conn.request("GET", "/", headers={"Cookie": cookie} if cookie else {})
    r = conn.getresponse()
    body = r.read().decode(errors="replace")
    conn.close()
    m = re.search(r'"kernelId":\s*"([0-9a-f-]{36})"', body)
    session = next((c.split(";")[0] for c in r.headers.get_all("Set-Cookie") or [] if c.startswith(SESSION_COOKIE)),
                   cookie)
    return r.status, m.group(1) if m else "", session


def shutdown(port: int, kernel_id: str, cookie: str = "") -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    cookies = "; ".join(c for c in (f"_xsrf={XSRF}", cookie) if c)
    conn.request("POST", f"/voila/api/shutdown/{kernel_id}", body=b"",
                 headers={"Cookie": cookies, "X-XSRFToken": XSRF})
    r = conn.getresponse()
    body = r.read().decode(errors="replace")
    conn.close()
    return r.status, body


def kernels_of(proc: subprocess.Popen) -> int:
    return sum("kernel" in " ".join(p.cmdline()) for p in psutil.Process(proc.pid).children(recursive=True))


def test_another_session_cannot_shut_down_a_kernel(small_server):
    port, proc = small_server
    code, kernel, session = load(port)
    assert code == 200 and kernel and session
    refused = shutdown(port, kernel)                               # a second client: an _xsrf pair, no session
    assert refused[0] == 403 and "another page session" in refused[1], refused
    assert shutdown(port, kernel, f"{SESSION_COOKIE}=forged")[0] == 403
    assert status(port, f"/api/kernels/{kernel}", {"Cookie": session})[0] == 200     # still alive, still its own
    own = shutdown(port, kernel, session)                          # its own page may shut it down
    assert own[0] == 204, own
    deadline = time.monotonic() + 30
    while kernels_of(proc) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert kernels_of(proc) == 0


def test_concurrent_loads_start_at_most_the_cap(small_server):
    port, proc = small_server
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        loads = list(pool.map(lambda _: load(port), range(16)))
    served = [k for code, k, _ in loads if code == 200 and k]
    assert len(served) == BIG_CAP and sorted(code for code, *_ in loads).count(503) == 16 - BIG_CAP, loads
    assert len(set(served)) == BIG_CAP and kernels_of(proc) <= BIG_CAP
