"""run.json survives concurrent writers (a Slurm job's supervisor and driver both update it)."""

import json
import multiprocessing as mp

from relax_core.launch.rundir import RunDir


def _writer(path, prefix, count):
    run = RunDir(path)
    for i in range(count):
        run.update_state(**{f"{prefix}{i}": i})


def test_concurrent_updates_lose_nothing_and_stay_valid_json(tmp_path):
    run = RunDir(tmp_path / "run").create()
    procs = [mp.get_context("spawn").Process(target=_writer, args=(run.path, p, 40)) for p in "ab"]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
    state = json.loads((run.path / "run.json").read_text())
    assert {f"{p}{i}" for p in "ab" for i in range(40)} <= set(state)


def test_secrets_are_private(tmp_path):
    run = RunDir(tmp_path / "run").create()
    path = run.write_secret("token")
    assert oct(path.stat().st_mode & 0o777) == "0o600" and oct(run.secrets.stat().st_mode & 0o777) == "0o700"
    assert len(run.secret("token")) >= 32
