"""The GPU gate keeps running: `tests/gpu/check.py --device cpu` runs every part's code path here.

The check runs on a GPU machine only now and then (and never in CI), so a change to a trainer, the
offload, the IPC payloads or the weight group could break it unseen until the next GPU run wastes its
minutes. Here every part runs on a small model and short responses on the CPU and must pass its own
checks; the last line is the JSON object the GPU run's figures go into.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PARTS = {"model", "fsdp", "megatron", "parity", "checkpoint", "ipc", "weights"}


@pytest.mark.full(covered_by="tests/integration/test_megatron_gpu_path.py::test_a_step_on_an_accelerator_keeps_every_tensor_there_and_gives_the_cpus_numbers[one-rank-fp32]")
def test_every_part_of_the_gpu_check_passes_on_the_cpu(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "gpu" / "check.py"), "--device", "cpu",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert PARTS <= set(result), sorted(result)
    assert json.loads((tmp_path / "check.json").read_text()) == result
    assert all(not result[part].get("failed") and "error" not in result[part] for part in PARTS - {"model"})
    for algorithm in ("grpo", "dapo", "ppo"):
        for backend in ("fsdp", "megatron"):
            assert result[backend][algorithm]["optimizer_steps"] == 2, (backend, algorithm)
    assert result["checkpoint"]["resumed_bit_exact"] and result["ipc"]["opened"]["ok"]
