"""`relax scale-rollout +N | -N | N [RUN]` and `relax scale-rollout --url URL [RUN]`: grow or shrink the
rollout side of a running run (controller/elastic.py does it; this asks the run's control API through the
run directory, launch/control.py, so it works from a login node that cannot reach the driver's node)."""

from __future__ import annotations

import re
import time
import uuid

import typer

from relax_cli.common import EXIT_RUNTIME_ERROR, fail, out

CHANGE = re.compile(r"^[+-]?\d+$")
POLL_S = 0.5


def scale_rollout(
    args: list[str] = typer.Argument(None, metavar="[+N|-N|N] [RUN]",
                                     help="+N engines, -N (the newest added ones), or N in all; then the run "
                                          "directory or name (default: the newest run under ./runs)."),
    url: str = typer.Option(None, "--url", help="Add the engine serving at this URL (started elsewhere with the "
                                                "run's model and engine key); it gets the current weights first."),
) -> None:
    """Add or remove rollout engines of a running run; on Slurm, +N submits a job for the new nodes.
    Follows the operation until it is done (Ctrl-C stops following; the operation goes on)."""
    from relax_core.launch.control import ControlClient
    from relax_core.rundir import find_run

    args = list(args or [])
    change = args.pop(0) if args and CHANGE.match(args[0]) else None
    if len(args) > 1:
        fail(f"unexpected arguments: {' '.join(args[1:])}; usage: relax scale-rollout +N|-N|N [RUN]")
    if (change is None) == (url is None):
        fail("give a change (+N, -N, or a count N) or --url URL, not both and not neither")
    body: dict = {"request_id": uuid.uuid4().hex}  # retried by hand or not, carried out once
    if url is not None:
        body["url"] = url
    elif change[0] in "+-":
        body["delta"] = int(change)
    else:
        body["target"] = int(change)
    client = ControlClient(find_run(args[0] if args else None))
    started = time.monotonic()
    code, op = client.call("POST", "/v1/scale", json=body)
    if code in (400, 404, 409):
        fail(op.get("error", str(op)))
    if code not in (200, 202):
        fail(f"the control API answered {code}: {op.get('error', op)}", EXIT_RUNTIME_ERROR)
    if op.get("id") is None:
        out.print(op.get("message", "nothing to do"), markup=False)
        return
    out.print(f"scale operation {op['id']}: {op['kind']} {op['count']} ({op['source']}) {op['state']}", markup=False)
    seen = op["state"]
    while op["state"] not in ("active", "stopped", "failed", "cancelled"):
        time.sleep(POLL_S)
        code, op = client.call("GET", f"/v1/scale/{op['id']}")
        if code != 200:
            fail(f"the control API answered {code}: {op.get('error', op)}", EXIT_RUNTIME_ERROR)
        if op["state"] != seen:
            seen = op["state"]
            job = f" (Slurm job {op['slurm_job_id']})" if op.get("slurm_job_id") else ""
            out.print(f"  {time.monotonic() - started:7.1f}s  {seen}{job}", markup=False)
    if op["state"] in ("failed", "cancelled"):
        fail(f"scale operation {op['id']} {op['state']}: {op.get('error') or ''}", EXIT_RUNTIME_ERROR)
    out.print(f"engines: {', '.join(op['engines'])} {'serving' if op['kind'] == 'out' else 'removed'}", markup=False)
