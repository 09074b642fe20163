"""Wait, with a bound and without polling, for processes that are not necessarily our children."""

from __future__ import annotations

import os
import select
import time
from collections.abc import Iterable
from pathlib import Path


def wait_for_exit(pids: Iterable[int], timeout_s: float, what: str = "processes") -> None:
    """Block until every process in ``pids`` has exited (children or not); fail the test past ``timeout_s``.

    Waits on Linux pidfds, which become readable when their process terminates, so it returns as soon as
    the last one is gone.
    """
    poller, opened, running = select.poll(), [], {}
    try:
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                continue  # already gone
            opened.append(fd)
            running[fd] = pid
            poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + timeout_s
        while running:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{what}: still running after {timeout_s} s: {sorted(running.values())}")
            for fd, _ in poller.poll(left * 1000):
                poller.unregister(fd)
                del running[fd]
    finally:
        for fd in opened:
            os.close(fd)


def descendants(pid: int) -> set[int]:
    """Every live descendant of ``pid``, from ``/proc/<pid>/task/*/children``."""
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    todo.append(child)
    return found
