"""A whole local run scored by an LLM judge that Relax starts and stops itself (`reward.genrm`).

`relax submit` of the quick start with `reward.name: genrm` and a judge model
directory built here (`echo_judge_model`: it repeats its prompt's last
character, so a template ending in "score 7" is answered "7", a score of 0.7).
Every sample of every step is judged: each step's reward mean is exactly 0.7
with no reward errors (an unjudged sample would score 0). The judge's two
engines logged to the run directory, its key is a run secret, and when the
run is over no judge engine server runs any more. Steps are 4 prompts x 4
samples: each sample costs a judge call, and 16 already reach both judges.
"""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path

import pytest
import yaml
from model_dirs import echo_judge_model
from relax_runs import relax as relax_cli

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = yaml.safe_load((REPO / "recipes" / "quickstart.yaml").read_text())
STEPS = 3
ROLLOUT = {"prompts_per_step": 4, "n_samples_per_prompt": 4}  # 16 judge calls a step, 8 per judge engine


relax = partial(relax_cli, timeout=600, drop=("RELAX_GENRM_URL",))  # whole runs: longer than a command's 120 s


# the driver's hub, or the rollout service's
@pytest.mark.parametrize("mode", ["colocate", pytest.param("fully_async", marks=pytest.mark.full(
    covered_by="tests/integration/test_genrm_run.py::"
               "test_a_run_judged_by_the_judge_relax_starts_and_stops[colocate]"))])
def test_a_run_judged_by_the_judge_relax_starts_and_stops(tmp_path: Path, mode: str):
    judge = echo_judge_model(tmp_path / "judge")
    genrm = {"model": "judge", "num_engines": 2, "max_new_tokens": 1,
             "template": "grade {response} vs {label}, score 7"}
    raw = QUICKSTART | {"reward": {"name": "genrm", "timeout_s": 120, "max_error_frac": 1.0, "genrm": genrm},
                        "train": QUICKSTART["train"] | {"steps": STEPS}, "rollout": QUICKSTART["rollout"] | ROLLOUT,
                        "logging": {"backends": []}, "mode": mode}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(raw))
    proc = relax("submit", "recipe.yaml", "--executor", "local", "--run-dir", "run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:  # every one of the step's samples got the judge's 0.7
        assert row["reward_mean"] == pytest.approx(0.7) and row["reward_errors"] == 0, row
    assert sorted(p.name for p in (run / "logs").glob("judge-*.log")) == ["judge-0.log", "judge-1.log"]
    assert "judge engines ready: http://127.0.0.1:" in (run / "logs" / "driver.log").read_text()
    assert oct((run / "secrets" / "judge_api_key").stat().st_mode & 0o777) == "0o600"
    assert not _judge_servers(judge), "judge engine servers outlived the run"


def _judge_servers(model: Path) -> list[int]:
    """Engine server processes serving `model` (their command line names it)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "relax_core.rollout.cpu_engine" in command and str(model.resolve()) in command:
            found.append(int(pid))
    return found
