"""How a test's gloo rank ends: once every rank is done, without tearing the process group down.

gloo's teardown (destroy_process_group, or the interpreter's at exit) while a peer closes its end
can abort a process ("terminate called without an active exception"), as seen in CI; Megatron's
dozens of gloo groups can block it too. The product never destroys its default group either: its
workers end with their process.
"""

from __future__ import annotations

import os
import sys


def leave_group() -> None:
    """Call last in a rank (in a `finally:` too): when the rank's work is done, wait for every rank and
    exit at once; when an exception is on its way out, return and let it fail the rank as usual."""
    if sys.exc_info()[0] is not None:
        return
    import torch.distributed as dist

    dist.barrier()  # no rank leaves while another still talks to it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
