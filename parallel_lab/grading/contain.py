"""What keeps a submission's processes inside the grader: namespaces where Linux allows them, a sweep of
every descendant, guards in the submission's interpreter, feedback without hidden tests.

* Namespaces (:func:`isolate`: unprivileged user, mount and network namespaces): the bundle is covered by an
  empty tmpfs and the network is loopback only, for every process the submission starts, programs included.
* Sweep: the grader is a *child subreaper* (``prctl(PR_SET_CHILD_SUBREAPER)``): a process that leaves the
  submission's session (``setsid``) is re-parented to the grader, and :func:`sweep` kills every descendant
  found in ``/proc`` after each submission. No PID namespace: the sweep is what ends them all.
* Guards (:func:`guard_hook`, an audit hook inherited by forked ranks): no fixed port, no program started
  (``subprocess``, ``os.exec*``, ``os.system``, ``posix_spawn``), no connection off the machine.
* Verdicts: the submission's process only records what its code hands back; a judge that never runs its
  code decides, once every process of it is gone (:mod:`parallel_lab.grading.tape`).
* Feedback (:func:`clean_message`): bounded, and withheld when it quotes a line of a hidden test file.

* Hidden tests: never in the submission's process (:mod:`parallel_lab.grading.remote`); the grader's own
  memory is closed to other processes of its user (:func:`undumpable`).

Limits: without namespaces the bundle's files stay readable to the grader's user, and a grader run as root
without them leaves every process's memory readable; a submission can fake what a test measures in its
process (its outputs, not the verdict). Grade untrusted classes inside a container as well.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import ipaddress
import os
import signal
import socket
import struct
import time
from collections.abc import Iterable
from pathlib import Path

PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 1, 4, 36
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 2, 4, 0x4000, 0x40000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
MAX_MESSAGE = 600          #: characters of feedback per test
MAX_OUTPUT = 1 << 20       #: bytes a submission may print (stdout and stderr together) per process
_PROGRAMS = ("subprocess.Popen", "os.exec", "os.posix_spawn", "os.system")


def _prctl(option: int, value: int) -> bool:
    """Linux's ``prctl(option, value)``; False where the call is unavailable or refused."""
    try:
        return int(ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def become_subreaper() -> bool:
    """Make this process adopt its orphaned descendants (Linux); False where the call is unavailable."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


def undumpable() -> bool:
    """Make this process's memory and files unreadable through ``/proc`` to processes without
    ``CAP_SYS_PTRACE`` (``prctl(PR_SET_DUMPABLE, 0)``; its forks too); False where unavailable."""
    return _prctl(PR_SET_DUMPABLE, 0)


def die_with_parent() -> bool:
    """Have the kernel kill this process (SIGKILL) when its parent exits (``PR_SET_PDEATHSIG``)."""
    return _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _table() -> dict[int, tuple[int, int, bool]]:
    """``pid -> (ppid, session id, zombie)`` of every process in ``/proc``."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rindex(b")") + 2:].split()
            out[int(name)] = (int(fields[1]), int(fields[3]), fields[0] == b"Z")
    return out


def descendants(root: int, skip: Iterable[int] = ()) -> dict[int, tuple[int, int, bool]]:
    """Every process below ``root`` (``pid -> (ppid, session, zombie)``) but the subtrees rooted at ``skip``."""
    table, skip = _table(), set(skip)
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        kids.setdefault(ppid, []).append(pid)
    out: dict[int, tuple[int, int, bool]] = {}
    todo = [p for p in kids.get(root, []) if p not in skip]
    while todo:
        pid = todo.pop()
        if pid not in out:
            out[pid] = table[pid]
            todo += kids.get(pid, [])
    return out


def sweep(session: int, keep: Iterable[int] = (), rounds: int = 200) -> int:
    """Kill and reap every descendant of this process but the subtrees of ``keep``; the number of live ones
    that had left ``session`` (``setsid``: escapes from the submission's process group)."""
    escaped: set[int] = set()
    for _ in range(rounds):
        found = descendants(os.getpid(), keep)
        if not found:
            break
        for pid, (_, sid, zombie) in found.items():
            if not zombie and sid != session:
                escaped.add(pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)
        for pid in found:                     # only the ones found: never another child of this process
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
    return len(escaped)


def isolate(hide: Iterable[Path]) -> str:
    """Enter new user, mount and network namespaces (Linux, unprivileged): ``hide`` (the bundle) is covered by
    an empty tmpfs and the network is loopback only, for this process and all it starts. '' when done, else
    why not (the caller carries on without them: the sweep and the audit hook still hold)."""
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0:
        return f"unshare: {os.strerror(ctypes.get_errno())}"
    try:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
            return f"mount --make-rprivate /: {os.strerror(ctypes.get_errno())}"
        for d in hide:
            if libc.mount(b"tmpfs", str(d).encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"size=64k,mode=0500") != 0:
                return f"mount tmpfs on {d}: {os.strerror(ctypes.get_errno())}"
        if libc.unshare(CLONE_NEWNET) != 0:                 # last: without lo up the ranks could not meet
            return f"unshare the network: {os.strerror(ctypes.get_errno())}"
        with socket.socket() as s:                          # bring up lo: the ranks rendezvous on 127.0.0.1
            flags = struct.unpack("16sh", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sh", b"lo", 0)))[1]
            fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | IFF_UP))
    except OSError as e:
        return f"namespaces: {e}"
    return ""


def guard_hook(event: str, args: tuple) -> None:
    """The audit hook of a submission's process: refuse fixed ports, new programs and remote hosts."""
    if event == "socket.bind" and len(args) >= 2:
        addr = args[1]
        if isinstance(addr, tuple) and len(addr) >= 2 and isinstance(addr[1], int) and addr[1] != 0:
            raise PermissionError(f"the submission bound a fixed port {addr[1]}; fixed ports collide when two "
                                  "jobs run at once: let the OS pick one (bind to port 0) or use the launcher")
    elif event.startswith(_PROGRAMS):
        raise PermissionError(f"the submission started a program ({event}); graded code runs in Python only, "
                              "without subprocesses")
    elif event == "socket.connect" and len(args) >= 2 and isinstance(args[1], tuple) and args[1]:
        host = str(args[1][0])
        try:
            local = ipaddress.ip_address(host).is_loopback
        except ValueError:
            local = host == "localhost"
        if not local:
            raise PermissionError(f"the submission connected to {host[:60]}; graded code has no network")


def secret_lines(texts: Iterable[str]) -> set[str]:
    """The lines of hidden test files long enough to identify them (what feedback must never quote)."""
    return {t for text in texts for line in text.splitlines() if len(t := line.strip()) > 25}


def clean_message(message: object, secret: set[str]) -> str:
    """Feedback as the learner sees it: text, at most :data:`MAX_MESSAGE` characters, without hidden source."""
    text = message if isinstance(message, str) else repr(message)
    if any(line in text for line in secret):
        return ("the message of this failure quoted the hidden tests' source, so it is withheld; raise errors "
                "that say what your code found, without reading the test files")
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE - 6] + " [...]"
