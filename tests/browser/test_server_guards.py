"""The app server's guards (issue 18), against the real server in headless Chromium.

One server for the module, started the way ``make app`` starts it (:func:`serve.voila_argv`) with
``max_kernels=2``. A request with a foreign ``Host`` (the shape of DNS rebinding: the attacker's name
resolving to 127.0.0.1) is refused, page, static files and kernel websocket alike; a second browser
session that knows the first one's kernel id can neither reach its REST handler nor open its websocket,
while the first session's own page works; past the kernel cap the page is a clear 503.
"""

from __future__ import annotations

import http.client
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request

import pytest
from test_app import ARTIFACTS, psutil, sync_api  # noqa: F401 (skips as test_app does)

from parallel_lab.viz.browser import LAUNCH_ARGS, chromium_path
from parallel_lab.viz.serve import REPO, free_port, voila_argv, voila_env

CHROMIUM = chromium_path()

pytestmark = pytest.mark.browser
CAP = 2


@pytest.fixture(scope="module")
def server():
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = open(ARTIFACTS / "voila-guards.log", "w")  # noqa: SIM115 - closed at teardown
    proc = subprocess.Popen(voila_argv(port, max_kernels=CAP), env=voila_env(), cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            log.close()
            pytest.fail(f"the server exited with {proc.returncode}: "
                        f"{(ARTIFACTS / 'voila-guards.log').read_text()[-2000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/voila/static/voila.js", timeout=2).read()
            break
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail("the server did not answer within 120 s")
            time.sleep(0.3)
    yield port
    kernels = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    finally:
        _, alive = psutil.wait_procs(kernels, timeout=15)
        for p in alive:
            p.kill()
        log.close()


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
