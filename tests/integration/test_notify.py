"""A run's events reach the recipe's notifiers (`logging.notify`, through Apprise), as a user sees them.

A real loopback HTTP server takes Apprise's `json://` webhook posts. The runs are test_recovery.py's (one
run each is enough): its colocate quick start sends started (run directory), a summary every
`logging.notify_every` steps (reward, throughput, staleness), each checkpoint, each engine restart and
finished, while a second URL that nobody answers changes nothing for the run; its run whose engine may
not be replaced sends failed, with the cause and the log to read. Here: a mistaken URL is refused.
"""

from __future__ import annotations

import subprocess
import sys

from relax_runs import cli_env
from test_elastic import QUICKSTART
from webhook import Webhook


def told_about_a_run(webhook: Webhook, run) -> None:
    """What a 150-step run with `logging.notify_every=40`, `checkpoint.interval=60` and one engine restart
    sent (test_recovery.py runs it): started, summaries, checkpoints, the restart, finished."""
    titles = webhook.titles()
    assert titles[0] == "started" and titles[-1] == "finished", titles
    assert [t for t in titles if t.startswith("step ")] == ["step 40", "step 80", "step 120"]
    assert titles.count("checkpoint") == 3 and titles.count("engine restarted") == 2
    body = {t: p["message"] for t, p in zip(titles, webhook.posts)}
    assert str(run) in body["started"]
    assert "reward" in body["step 40"] and "tok/s" in body["step 40"] and "staleness" in body["step 40"]
    assert "step 150 saved" in body["checkpoint"]  # the last one
    assert "engine e0" in body["engine restarted"]
    assert "150 steps" in body["finished"]
    assert webhook.posts[-1]["type"] == "success"


def test_a_url_apprise_cannot_use_is_refused_before_anything_starts(tmp_path):
    done = subprocess.run([sys.executable, "-m", "relax_cli.main", "submit", str(QUICKSTART), "--executor", "local",
                           'logging.notify=["ntfy://topic", "nosuch://x"]', "--run-dir", "run"],
                          cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "logging.notify" in done.stderr + done.stdout and "entry 2 (nosuch://...)" in done.stderr + done.stdout
    assert not (tmp_path / "run").exists()
