"""How a test's gloo rank ends: once every rank is done, without tearing the process group down.

gloo's teardown (destroy_process_group, or the interpreter's at exit) while a peer closes its end
can abort a process ("terminate called without an active exception"), as seen in CI; Megatron's
dozens of gloo groups can block it too. The product never destroys its default group either: its
workers end with their process.

Leaving by `os._exit` skips what multiprocessing does at exit, so the rank ends the processes it
started itself first: Megatron's checkpoint writer (`dist_checkpointing.strategies.filesystem_async`)
starts a `multiprocessing.Manager` server in each saving rank, which waits forever for a parent that
is gone (found in CI: ten of them, 270 MB each, hours after their tests).
"""

from __future__ import annotations

import multiprocessing
import os
import sys


def leave_group() -> None:
    """Call last in a rank (in a `finally:` too): when the rank's work is done, wait for every rank and
    exit at once; when an exception is on its way out, return and let it fail the rank as usual."""
    if sys.exc_info()[0] is not None:
        return
    import torch.distributed as dist

    dist.barrier()  # no rank leaves while another still talks to it
    for child in multiprocessing.active_children():
        child.terminate()
        child.join(10)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
