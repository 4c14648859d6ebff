"""The clean parent of every submission's process: a fresh interpreter that never holds a hidden test.

A process forked from the grader would inherit its memory (the hidden tests' modules, text and reference
values). So the grader starts this *zygote* once, by ``exec`` (torch and the runtime imported, nothing of a
bundle), and asks it over a ``SOCK_SEQPACKET`` socket to fork each submission's process (the executor of
:mod:`parallel_lab.grading.remote`), passing the pipes' ends as file descriptors; the zygote answers the new
process's pid and, later, its exit status. The executor sets its session and limits, loads the public tests
(rank functions of theirs travel by name), enters the namespaces that hide the bundle, imports the submission
and serves the driver's requests.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
from typing import Any

_MAX = 1 << 16


class Zygote:
    """The grader's handle on the zygote: ``fork`` an executor, ``poll``/``wait`` for its exit status."""

    def __init__(self) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        code = (f"import sys; sys.path[:] = {sys.path!r}; from parallel_lab.grading.zygote import main; "
                f"main({theirs.fileno()})")
        self.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        theirs.close()
        self.exits: dict[int, int] = {}

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _read(self, timeout: float | None) -> bool:
        ready, _, _ = select.select([self.sock], [], [], timeout)
        if not ready:
            return False
        msg = self.sock.recv(_MAX)
        if not msg:
            raise OSError("the grader's zygote is gone")
        m = json.loads(msg)
        if "exit" in m:
            self.exits[int(m["exit"])] = int(m["status"])
        else:
            self.pid = int(m["pid"])
        return True

    def fork(self, spec: dict[str, Any], fds: list[int]) -> int:
        self.pid = 0
        socket.send_fds(self.sock, [json.dumps(spec).encode()], fds)
        while not self.pid:
            self._read(None)
        return self.pid

    def poll(self, pid: int) -> int | None:
        while pid not in self.exits and self._read(0):
            pass
        return self.exits.pop(pid, None)

    def wait(self, pid: int) -> int:
        while pid not in self.exits:
            self._read(None)
        return self.exits.pop(pid)

    def close(self) -> None:
        self.sock.close()
        self.proc.wait()


def main(fd: int) -> None:
    """The zygote's loop: fork an executor per request, report each one's exit; end when the grader does."""
    import torch

    import parallel_lab.distributed.runtime.run  # noqa: F401 - with the model, train and launch modules
    from parallel_lab.distributed.runtime.launch import prime_lazy_imports
    from parallel_lab.grading import contain, remote  # noqa: F401 - remote: warm for the executors

    torch.set_num_threads(1)
    prime_lazy_imports()
    contain.die_with_parent()                                    # the grader gone: so is the zygote
    sock = socket.socket(fileno=fd)
    while True:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            sock.send(json.dumps({"exit": pid, "status": status}).encode())
        ready, _, _ = select.select([sock], [], [], 0.02)
        if not ready:
            continue
        msg, fds, _, _ = socket.recv_fds(sock, _MAX, 8)
        if not msg:
            os._exit(0)
        pid = os.fork()
        if pid == 0:
            try:
                sock.close()
                _executor(json.loads(msg), fds)
            finally:
                os._exit(0)
        for f in fds:
            os.close(f)
        sock.send(json.dumps({"pid": pid}).encode())


def _executor(spec: dict[str, Any], fds: list[int]) -> None:
    """The submission's process: session, limits, public tests, namespaces, then :func:`remote.execute`."""
    from pathlib import Path

    from parallel_lab.grading import contain, judge, remote

    tape_w, out_w, request_r, reply_w = fds
    os.dup2(out_w, 1)
    os.dup2(out_w, 2)
    os.close(out_w)
    judge.confine(Path(spec["work"]), spec["memory_mb"], spec["cpu_s"], spec["scale"])
    if spec.get("public"):
        judge.load(Path(spec["public"]), "public_tests")
    if spec.get("isolate"):                # the bundle out of sight, loopback only (where Linux allows)
        contain.isolate([Path(d) for d in spec["hide"]])
    remote.execute(tape_w, request_r, reply_w, spec["work"])
