"""A webhook of one's own for the notification tests: a real HTTP server on 127.0.0.1 that keeps what
Apprise's `json://` posts to it (registered as the `webhook` fixture in conftest.py)."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


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
    """A loopback port nothing listens on (a notifier that is down)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def webhook():
    """A running `Webhook`, shut down after the test."""
    hook = Webhook()
    yield hook
    hook.close()
