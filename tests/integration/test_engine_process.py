"""How an engine server is started, waited for and stopped (rollout/engine_process.py), with real processes.

SGLang's server needs a GPU, so `EngineWorker` is pointed at a small script
through its `python` argument: the script receives exactly the command line
SGLang would (`-m relax_core.rollout.sglang_launch --model-path ...`), records
it, and then behaves as the test needs: crashes at once, loses its port to
another process, never becomes healthy, or serves `/health` beside a child
process of its own (as SGLang's scheduler processes are). The launcher's
in-process hand-over of the API key runs for real too, in front of a stand-in
for `sglang.launch_server` that reports what it was given.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from engine_fixtures import tiny_model_dir  # noqa: F401

from relax_core.rollout.engine_command import EngineSettings, engine_command
from relax_core.rollout.engine_process import EngineStartError
from relax_core.rollout.engine_worker import EngineWorker
from relax_core.rollout.sglang_engine import server_command

SGLANG = EngineSettings("sglang", "/models/qwen", seed=5, max_running_requests=32, tp_size=2,
                        engine_args={"mem_fraction_static": 0.7})

SCRIPT = textwrap.dedent("""\
    #!{python}
    import http.server, json, os, signal, subprocess, sys
    args = sys.argv[1:]
    host, port = args[args.index("--host") + 1], int(args[args.index("--port") + 1])
    mode, record = os.environ["ENGINE_MODE"], os.environ["ENGINE_RECORD"]
    starts = sum(1 for _ in open(record)) if os.path.exists(record) else 0
    child = subprocess.Popen([{python!r}, "-c", "import time; time.sleep(600)"])
    with open(record, "a") as f:
        f.write(json.dumps({{"argv": sys.argv, "key": os.environ.get("RELAX_ENGINE_API_KEY"),
                            "keep_alive": os.environ.get("SGLANG_TIMEOUT_KEEP_ALIVE"),
                            "pid": os.getpid(), "child": child.pid, "port": port}}) + "\\n")
    print("Loading safetensors checkpoint shards", flush=True)
    if mode == "crash":
        print("RuntimeError: CUDA error: out of memory", flush=True)
        sys.exit(3)
    if mode == "race" and starts == 0:
        print(f"ERROR:    [Errno 98] error while attempting to bind on address ('{{host}}', {{port}}): "
              "address already in use", flush=True)
        sys.exit(1)
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode == "silent":
        signal.pause()

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

    http.server.HTTPServer((host, port), Health).serve_forever()
    """)


@pytest.fixture
def fake_python(tmp_path, monkeypatch):
    """The script, and a function that starts an SGLang `EngineWorker` whose server it is, in a given mode."""
    script = tmp_path / "python"
    script.write_text(SCRIPT.format(python=sys.executable))
    script.chmod(0o755)
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("RELAX_NODE_IP", "127.0.0.1")
    monkeypatch.setenv("ENGINE_RECORD", str(record))
    started: list[EngineWorker] = []

    def start(mode: str, index: int = 0) -> EngineWorker:
        monkeypatch.setenv("ENGINE_MODE", mode)
        worker = EngineWorker(index, SGLANG, str(tmp_path / f"engine-{index}.log"), "s3cret", python=str(script))
        started.append(worker)
        return worker

    start.records = lambda: [json.loads(line) for line in record.read_text().splitlines()]
    yield start
    for worker in started:
        worker.stop()


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_an_engine_that_exits_at_once_is_named_with_the_tail_of_its_log(fake_python, tmp_path):
    worker = fake_python("crash", index=3)
    with pytest.raises(EngineStartError) as error:
        worker.wait_ready(timeout_s=60)
    message = str(error.value)
    assert message.startswith(f"engine 3 at {worker.url} exited with code 3 before it was healthy")
    assert str(tmp_path / "engine-3.log") in message
    assert "RuntimeError: CUDA error: out of memory" in message.splitlines()[-1]
    assert oct((tmp_path / "engine-3.log").stat().st_mode & 0o777) == "0o600"  # SGLang logs its key there


def test_an_engine_that_never_gets_healthy_times_out_naming_it(fake_python):
    worker = fake_python("silent")
    start = time.monotonic()
    with pytest.raises(EngineStartError, match=r"engine 0 at http://127\.0\.0\.1:\d+ not healthy after 2 s") as error:
        worker.wait_ready(timeout_s=2)
    assert time.monotonic() - start < 10
    assert "Loading safetensors checkpoint shards" in str(error.value)


def test_the_engine_gets_sglangs_command_line_and_its_key_only_in_the_environment(fake_python):
    worker = fake_python("serve", index=2)
    url = worker.wait_ready(timeout_s=60)
    (started,) = fake_python.records()
    assert url == f"http://127.0.0.1:{started['port']}"
    assert started["argv"][1:] == server_command(
        python="python", model_dir="/models/qwen", host="127.0.0.1", port=started["port"], tp_size=2, seed=5 + 2,
        max_running_requests=32, weight_version="0", engine_args={"mem_fraction_static": 0.7},
        trust_remote_code=False)[1:]
    assert started["argv"] == engine_command(SGLANG, 2, python=started["argv"][0], host="127.0.0.1",
                                             port=started["port"])
    assert started["key"] == "s3cret" and not any("s3cret" in arg for arg in started["argv"])
    # SGLang keeps an idle connection 5 s unless told; sglang-router pools its connections 50 to 90 s
    # (rollout/router.py, Keep-alive): the engine must hold them longer.
    assert int(started["keep_alive"]) > 90


def test_stop_ends_the_engines_whole_process_group(fake_python):
    worker = fake_python("serve")
    worker.wait_ready(timeout_s=60)
    (started,) = fake_python.records()
    assert alive(started["pid"]) and alive(started["child"])
    worker.stop()
    deadline = time.monotonic() + 10
    while alive(started["child"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(started["pid"]) and not alive(started["child"])  # the child, in the group, went too


def test_an_engine_that_ignores_sigterm_is_killed_after_the_timeout(fake_python):
    worker = fake_python("stubborn")
    worker.wait_ready(timeout_s=60)
    (started,) = fake_python.records()
    start = time.monotonic()
    worker.server.stop(timeout_s=1.0)
    assert 1.0 <= time.monotonic() - start < 8
    assert not alive(started["pid"]) and not alive(started["child"])


def test_a_port_another_process_took_is_replaced_by_a_fresh_one(fake_python, tmp_path):
    worker = fake_python("race")
    url = worker.wait_ready(timeout_s=60)
    first, second = fake_python.records()
    assert first["port"] != second["port"] and url.endswith(f":{second['port']}")
    assert not alive(first["child"]) and alive(second["child"])  # the failed start left nothing behind
    assert "address already in use" in (tmp_path / "engine-0.log").read_text()


def test_the_launcher_hands_sglang_the_key_in_process_not_on_the_command_line(tmp_path):
    """`sglang_launch` in front of a stand-in `sglang.launch_server` that reports its argv and command line."""
    package = tmp_path / "site" / "sglang"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "launch_server.py").write_text(
        "import json, os, sys\n"
        "if __name__ == '__main__':\n"
        "    cmdline = open('/proc/self/cmdline', 'rb').read().decode().split('\\0')\n"
        "    print(json.dumps({'argv': sys.argv, 'cmdline': cmdline,\n"
        "                      'env': os.environ.get('RELAX_ENGINE_API_KEY')}))\n")
    argv = server_command(python=sys.executable, model_dir="/m", host="127.0.0.1", port=30000, tp_size=1, seed=0,
                          max_running_requests=8, weight_version="0", engine_args={}, trust_remote_code=False)
    env = os.environ | {"PYTHONPATH": str(tmp_path / "site"), "RELAX_ENGINE_API_KEY": "s3cret"}
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    assert seen["argv"][1:] == argv[3:] + ["--api-key", "s3cret"]  # SGLang parses the key from its argv
    assert not any("s3cret" in part for part in seen["cmdline"])  # the process list never shows it
    assert seen["env"] is None  # and SGLang's own processes do not inherit it


def test_a_cpu_engine_keeps_an_idle_connection_open_longer_than_sglangs_default_5_s(
        tiny_model_dir, tmp_path, monkeypatch):  # noqa: F811
    """The router reuses a pooled connection after seconds of idleness; an engine that closed it at 5 s
    (uvicorn's and SGLang's default) fails the request written on it as it closes."""
    monkeypatch.setenv("RELAX_NODE_IP", "127.0.0.1")
    worker = EngineWorker(0, EngineSettings("cpu", str(tiny_model_dir), 0, 8), str(tmp_path / "engine.log"), "s3cret")
    try:
        host, port = worker.wait_ready(timeout_s=120).removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        headers = {"Authorization": "Bearer s3cret"}
        try:
            conn.request("GET", "/get_model_info", headers=headers)
            assert conn.getresponse().read() and conn.sock is not None, "the first request keeps its connection"
            first = conn.sock.getsockname()
            time.sleep(6.5)
            conn.request("GET", "/get_model_info", headers=headers)  # on a connection the engine closed: fails
            assert conn.getresponse().status == 200 and conn.sock.getsockname() == first
        finally:
            conn.close()
    finally:
        worker.stop()
