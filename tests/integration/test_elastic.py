"""A running run's rollout side grown and shrunk with `relax scale-rollout`, as a user does it.

A local `fully_async` quick start behind the router: its control API refuses
requests without (or with a wrong) token and impossible ones, and listens on
the driver's address only; `+1` starts an engine that gets the current
weights and serves, a second scale while one runs is refused, `-1` drains it
and stops it; an engine started by someone else joins by URL with the current
weights (its log-probs are the run's own engine's) and is left running when
it is removed. Every step meanwhile trains each sample once, within the
staleness bound (the driver checks both every step and fails the run
otherwise); then the run is stopped. The Slurm version, which runs to
completion, is in test_slurm_launch.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import psutil
import pytest
from engine_fixtures import EngineServer
from relax_runs import relax, start_relax, wait_for

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"
ELASTIC_RUN = ["mode=fully_async", "rollout.router=true", "rollout.max_staleness=1", "logging.backends=[]"]


class Api:
    """The run's control API, as run.json names it at each request (a job that restarts in its driver
    starts its API again on another port)."""

    def __init__(self, run: Path, url: str | None = None):
        """`url`: this address always, whatever run.json says."""
        self.run, self.fixed_url = run, url
        state = json.loads((run / "run.json").read_text())
        self.token_file = Path(state["api_token_file"])
        self.headers = {"Authorization": f"Bearer {self.token_file.read_text().strip()}"}

    @property
    def url(self) -> str:
        if self.fixed_url:
            return self.fixed_url
        state = json.loads((self.run / "run.json").read_text())
        assert state.get("api_url"), f"no control API in run.json: state {state.get('state')}, " \
                                     f"job restarts {state.get('job_restarts')}, error {state.get('error')}"
        return state["api_url"]

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers, timeout=30, **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        return httpx.post(self.url + path, headers=self.headers, timeout=30, **kw)

    def delete(self, path: str, **kw) -> httpx.Response:
        return httpx.delete(self.url + path, headers=self.headers, timeout=30, **kw)

    def engine(self, engine_id: str) -> dict:
        return self.get(f"/v1/engines/{engine_id}").json()


def engine_stats(url: str, key: str) -> dict:
    response = httpx.get(f"{url}/get_model_info", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    return response.json()["engine_stats"]


def answers(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=5)
    except httpx.HTTPError:
        return False
    return True


def api_up(run: Path, driver: subprocess.Popen, out: Path) -> bool:
    assert driver.poll() is None, out.read_text()[-3000:]
    state = json.loads((run / "run.json").read_text()) if (run / "run.json").exists() else {}
    return bool(state.get("api_url")) and (run / "metrics.jsonl").exists()


def greedy_logprobs(url: str, key: str) -> tuple[str, list[float]]:
    """(weight version, log-probs) of a fixed greedy answer from the engine at `url`."""
    body = {"input_ids": [5, 6, 7], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}}
    answer = httpx.post(f"{url}/generate", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30).json()
    meta = answer["meta_info"]
    return str(meta["weight_version"]), [entry[0] for entry in meta["output_token_logprobs"]]


def same_weights(first: str, second: str, key: str) -> tuple[str, float]:
    """The largest log-prob difference between two engines at one weight version (the run trains on
    meanwhile, so both answers are asked until they were given at the same version)."""
    for _ in range(200):
        version_a, a = greedy_logprobs(first, key)
        version_b, b = greedy_logprobs(second, key)
        if version_a == version_b:
            return version_a, max(abs(x - y) for x, y in zip(a, b))
    raise AssertionError("the two engines never answered at the same weight version")


@pytest.mark.full(covered_by="tests/integration/test_slurm_launch.py::test_scale_rollout_grows_the_job_onto_a_second_slurm_job_and_back")
def test_a_local_run_grows_and_shrinks_while_it_trains_through_its_api_or_its_run_directory(tmp_path):
    run, out = tmp_path / "run", tmp_path / "driver.out"
    driver = start_relax("submit", str(QUICKSTART), *ELASTIC_RUN, "train.steps=1000", "--executor", "local",
                         "--run-dir", "run", cwd=tmp_path, out=out)
    try:
        wait_for(lambda: api_up(run, driver, out), 300, "the control API and step 1", poll=0.2)
        api = Api(run)
        key = (run / "secrets" / "engine_api_key").read_text().strip()

        # Who may use it: the token's owner, on the driver's address only.
        assert oct(api.token_file.stat().st_mode & 0o777) == "0o600"
        assert httpx.get(api.url + "/v1/engines").status_code == 401
        wrong = httpx.get(api.url + "/v1/engines", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and "error" in wrong.json()
        assert httpx.get(api.url + "/v1/openapi.json").status_code == 401
        assert "/v1/scale" in api.get("/v1/openapi.json").json()["paths"]
        port = int(api.url.rsplit(":", 1)[1])
        listening = [c.laddr for c in psutil.Process(driver.pid).net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
        assert [a.ip for a in listening] == ["127.0.0.1"]
        removing_original = api.delete("/v1/engines/e0")
        assert removing_original.status_code == 400 and "original" in removing_original.json()["error"]
        assert api.post("/v1/scale", json={"delta": -1}).status_code == 400  # nothing added to remove
        assert api.post("/v1/scale", json={"delta": 1, "target": 2}).status_code == 400

        # +1: a new engine loads, gets the weights, serves; a second scale meanwhile is refused.
        asked = time.monotonic()
        grow = start_relax("scale-rollout", "+1", "run", cwd=tmp_path, out=tmp_path / "grow.out")
        op = wait_for(lambda: (api.get("/v1/scale").json()["operations"] or [None])[-1], 30, "the scale-out")
        busy = api.post("/v1/scale", json={"delta": 1})
        assert busy.status_code == 409 and op["id"] in busy.json()["error"]
        assert grow.wait(timeout=180) == 0, (tmp_path / "grow.out").read_text()
        added = api.engine(api.get(f"/v1/scale/{op['id']}").json()["engines"][0])
        assert added["state"] == "active" and added["origin"] == "added"
        wait_for(lambda: engine_stats(added["url"], key)["finished_requests"] > 0, 60, "the engine's first request",
                 poll=0.2)
        first_request_s = time.monotonic() - asked
        print(f"relax scale-rollout +1 -> the new engine's first request: {first_request_s:.1f}s")
        router = api.get("/v1/status").json()["router"]
        workers = httpx.get(f"{router}/workers", headers={"Authorization": f"Bearer {key}"}).json()["workers"]
        assert added["url"] in [w["url"] for w in workers]
        states = [h["state"] for h in api.get(f"/v1/scale/{op['id']}").json()["history"]]
        assert states == ["pending", "starting", "healthy", "syncing", "active"]

        # -1: the added engine is drained and stopped.
        shrink = relax("scale-rollout", "-1", "run", cwd=tmp_path)
        assert shrink.returncode == 0, shrink.stdout + shrink.stderr
        assert "e1 removed" in shrink.stdout
        wait_for(lambda: not answers(added["url"]), 30, "the removed engine's server to end", poll=0.2)

        # An engine someone else started joins by URL with the current weights, and is left running.
        outside = EngineServer(run / "model", tmp_path / "outside.log", key).start()
        try:
            outside.wait_healthy()
            joined = relax("scale-rollout", "--url", outside.base_url, "run", cwd=tmp_path)
            assert joined.returncode == 0, joined.stdout + joined.stderr
            version, diff = same_weights(api.engine("e0")["url"], outside.base_url, key)
            assert int(version) >= 1 and diff < 1e-5  # the run's weights, not the model directory's
            external = next(e for e in api.get("/v1/engines").json()["engines"] if e["origin"] == "external")
            assert api.delete(f"/v1/engines/{external['id']}").status_code == 202
            wait_for(lambda: api.engine(external["id"])["state"] == "stopped", 60, "the external engine to leave",
                     poll=0.2)
            still = httpx.get(f"{outside.base_url}/health", headers={"Authorization": f"Bearer {key}"})
            assert still.status_code == 200  # removed from the run, not stopped: the run did not start it
        finally:
            outside.stop()

        # A login node often cannot reach the driver's compute node: with the API's recorded address
        # unreachable, `relax scale-rollout +1` still grows the run, through requests in the run directory.
        # A request there that another user could have written (group/world-writable, another owner) is
        # removed unread.
        api = Api(run, url=api.url)  # the test's own way in
        control = run / "control"
        assert oct(control.stat().st_mode & 0o777) == "0o700"
        state = json.loads((run / "run.json").read_text())
        (run / "run.json").write_text(json.dumps(state | {"api_url": "http://192.0.2.1:9"}))  # not reachable
        operations = api.get("/v1/scale").json()["operations"]
        forged = {"method": "POST", "path": "/v1/scale", "json": {"delta": 1}}
        for name, mode, owner in (("writable", 0o666, os.getuid()), ("others", 0o600, 65534)):
            path = control / f"{name}.request.json"
            path.write_text(json.dumps(forged))
            path.chmod(mode)
            os.chown(path, owner, -1)
            wait_for(lambda p=path: not p.exists(), 10, f"the driver to remove {path.name}", poll=0.1)
            assert not (control / f"{name}.answer.json").exists()
        assert api.get("/v1/scale").json()["operations"] == operations  # neither was obeyed
        driver_log = (run / "logs" / "driver.log").read_text()
        assert "writable by others" in driver_log and "owned by uid 65534" in driver_log
        grow = relax("scale-rollout", "+1", "run", cwd=tmp_path, timeout=240)
        assert grow.returncode == 0, grow.stdout + grow.stderr
        op = api.get("/v1/scale").json()["operations"][-1]
        assert op["state"] == "active" and f"engines: {op['engines'][0]} serving" in grow.stdout
        assert list(control.iterdir()) == []  # every request answered, every answer taken

        driver.send_signal(signal.SIGTERM)  # enough steps seen: stop (checkpointed) rather than train them all
        assert driver.wait(timeout=120) == 3, out.read_text()[-3000:]
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    # Every step logged passed the driver's check: each sample trained on once, none staler than the bound.
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert max(r["staleness_max"] for r in rows) <= 1
    engines = [r["engines"] for r in rows]
    changes = [n for i, n in enumerate(engines) if i == 0 or n != engines[i - 1]]
    assert changes[:3] == [1.0, 2.0, 1.0], engines  # grown, then shrunk
