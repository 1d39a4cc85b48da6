"""Running test functions on several processes with hard deadlines (imported by the tests and,
through spawn, by the worker processes)."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

JOIN_TIMEOUT_S = 420.0  # a whole matrix on a loaded 2-core box; a hang fails the test, never CI
GROUP_TIMEOUT_S = 60.0  # every collective of the workers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_worker(rank: int, world_size: int, port: int) -> None:
    """Join a gloo job of ``world_size`` processes on loopback (collective timeout 60 s)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=GROUP_TIMEOUT_S)
    )


def _entry(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple) -> None:
    import torch.distributed as dist

    init_worker(rank, world_size, port)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def start_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Start ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes joined in one
    gloo group; returns the processes."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, rank, world_size, port, args), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    return procs


def join_ranks(procs: list[Any], *, timeout_s: float) -> list[int | None]:
    """Exit codes of ``procs`` after waiting at most ``timeout_s`` in all; a process still
    alive then is killed and reported as ``None`` (the caller's assertion fails)."""
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0.0))
    codes = []
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(10)
            codes.append(None)
        else:
            codes.append(p.exitcode)
    return codes


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = JOIN_TIMEOUT_S
) -> list[int | None]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; their exit codes."""
    return join_ranks(start_ranks(fn, world_size, *args), timeout_s=timeout_s)
