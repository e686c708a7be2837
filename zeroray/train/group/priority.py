"""A rank's CPU priority: normal while it trains, ahead of the node's running work while it starts.

Ray starts worker processes at niceness 15 over the raylet's, below the node's other work. The ranks are
the job's main work (as Ray Jobs does for its drivers), so they train at the raylet's niceness: at 15 any
other busy process on the node starves them into collective timeouts.

A new rank's start (its process, torch, zeroray, the imports ahead: about 3.5 s of CPU) is on the critical
path of a grow or a replacement: the group runs smaller, or waits, until it is ready. The ranks already
running on the node lose the same CPU time to it at any priority, only sooner. So a rank starts at
``START_NICENESS`` where the node allows it (CAP_SYS_NICE; elsewhere Ray's ``nice()`` fails and it starts
at 0) and goes back to the raylet's niceness (normally 0) once its imports are done.
"""

from __future__ import annotations

import os

START_NICENESS = -10

# Ray's core worker applies RAY_worker_niceness at its start; Ray merges these env_vars into the job's
# runtime_env.
RANK_RUNTIME_ENV = {"env_vars": {"RAY_worker_niceness": str(START_NICENESS)}}


def _thread_ids() -> list[int]:
    tasks = "/proc/self/task"
    return [int(t) for t in os.listdir(tasks)] if os.path.isdir(tasks) else [0]


def threads_niceness() -> list[int]:
    """The niceness values of this process's threads (a thread that ends while they are read is left out)."""
    found = set()
    for tid in _thread_ids():
        try:
            found.add(os.getpriority(os.PRIO_PROCESS, tid))
        except ProcessLookupError:
            pass
    return sorted(found)


def to_normal_priority() -> int:
    """Every thread of this process back to the niceness of the raylet that started it (its parent); returns
    the niceness the start ran at. Linux keeps a niceness per thread, and the threads started since Ray's
    ``nice()`` have the start's; raising a niceness needs no privilege."""
    start = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        normal = os.getpriority(os.PRIO_PROCESS, os.getppid())
    except ProcessLookupError:  # the raylet is gone: this process is about to be, too
        normal = 0
    for tid in _thread_ids():
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < normal:
                os.setpriority(os.PRIO_PROCESS, tid, normal)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
    return start
