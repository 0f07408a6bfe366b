"""Multi-process test harness: run a worker function on several CPU ranks with gloo.

``spawn(worker, *args)`` calls ``worker(rank, *args)`` in ``nprocs`` fresh processes and
raises if any of them fails. A worker that returns normally has its process group (if any
is still up) brought down together with its peers, then leaves through ``os._exit(0)``:
a gloo group's threads torn down by the interpreter's exit can abort an otherwise
finished process ("terminate called without an active exception", SIGABRT), which
``mp.spawn`` would report as a failure of work already done and saved. Workers report
their results through files, so nothing is lost by skipping interpreter teardown.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(worker: Callable[..., None], *args: object, nprocs: int = 2) -> None:
    mp.spawn(_run_rank, args=(worker, args), nprocs=nprocs, join=True)


def _run_rank(rank: int, worker: Callable[..., None], args: tuple) -> None:
    worker(rank, *args)  # an exception propagates: mp.spawn reports it with its traceback
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # no rank tears its group down while a peer still talks to it
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
