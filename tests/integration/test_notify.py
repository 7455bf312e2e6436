"""A run's events reach the recipe's notifiers (`logging.notify`, through Apprise), as a user sees them.

A real loopback HTTP server takes Apprise's `json://` webhook posts. A quick start of 100 steps sends:
started (run directory), a summary every `logging.notify_every` steps (reward, throughput, staleness),
each checkpoint, the engine restart after its engine is killed by PID, and finished; a second URL that
nobody answers changes nothing for the run. A run whose engine may not be replaced sends failed, with
the cause and the log to read.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from test_elastic import QUICKSTART, start_relax
from test_recovery import ends_with, kill_engine_after


class Webhook:
    """An HTTP server on 127.0.0.1 that keeps every JSON body posted to it."""

    def __init__(self):
        self.posts: list[dict] = []
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                hook.posts.append(json.loads(body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"json://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def titles(self) -> list[str]:
        return [p["title"].split(": ", 1)[1] for p in self.posts]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def webhook():
    hook = Webhook()
    yield hook
    hook.close()


@pytest.mark.slow
def test_a_run_tells_its_notifiers_what_happens(tmp_path, webhook):
    run, out = tmp_path / "run", tmp_path / "driver.out"
    urls = f'["{webhook.url}", "json://127.0.0.1:{closed_port()}/nobody"]'
    driver = start_relax("submit", str(QUICKSTART), "train.steps=100", "logging.backends=[]",
                         f"logging.notify={urls}", "logging.notify_every=40", "checkpoint.interval=60",
                         "--executor", "local", "--run-dir", "run", cwd=tmp_path, out=out)
    kill_engine_after(run, driver, 3)
    assert ends_with(driver, 300) == 0, out.read_text()[-3000:]
    titles = webhook.titles()
    assert titles[0] == "started" and titles[-1] == "finished", titles
    assert [t for t in titles if t.startswith("step ")] == ["step 40", "step 80"]
    assert titles.count("checkpoint") == 2 and titles.count("engine restarted") == 1
    body = {t: p["message"] for t, p in zip(titles, webhook.posts)}
    assert str(run) in body["started"]
    assert "reward" in body["step 40"] and "tok/s" in body["step 40"] and "staleness" in body["step 40"]
    assert "step 60 saved" in body["checkpoint"] or "step 100 saved" in body["checkpoint"]
    assert "engine e0" in body["engine restarted"]
    assert "100 steps" in body["finished"]
    assert webhook.posts[-1]["type"] == "success"


@pytest.mark.slow
def test_a_failed_run_sends_its_cause_and_log(tmp_path, webhook):
    run, out = tmp_path / "run", tmp_path / "driver.out"
    driver = start_relax("submit", str(QUICKSTART), "train.steps=150", "logging.backends=[]",
                         f'logging.notify=["{webhook.url}"]', "recovery.max_engine_restarts=0",
                         "--executor", "local", "--run-dir", "run", cwd=tmp_path, out=out)
    kill_engine_after(run, driver, 2)
    assert ends_with(driver, 120) == 1, out.read_text()[-3000:]
    failed = webhook.posts[-1]
    assert failed["title"].endswith("failed") and failed["type"] == "failure"
    assert "engine e0" in failed["message"] and str(run / "logs" / "driver.log") in failed["message"]
