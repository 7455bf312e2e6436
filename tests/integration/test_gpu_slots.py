"""Ray places the GPU recipe's trainer ranks and engines where the plan says, within the node's GPUs.

A Ray node started with a GPU count but no GPUs still assigns GPU ids and sets
CUDA_VISIBLE_DEVICES for each actor, so the placement itself is real here: the
trainer ranks are real `TrainerWorker` actors, the engines are started by the
real `EngineSet` (controller/gpu_slots.py's options) through `EngineWorker`
and `sglang_launch`. Only SGLang is a stand-in, an installed package of no
server arguments whose server (`FAKE_SGLANG`) records the CUDA_VISIBLE_DEVICES
it was started with and answers `/health`.

Each case runs in a process of its own (its own Ray node): a Ray client reads
its auth token once per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

FAKE_SGLANG = '''
"""Stands in for `python -m sglang.launch_server` where there is no GPU: records its GPUs, answers /health."""
import argparse, http.server, os, pathlib
parser = argparse.ArgumentParser()
for flag in ("--host", "--port", "--random-seed"):
    parser.add_argument(flag)
args, _ = parser.parse_known_args()
record = pathlib.Path(os.environ["RECORD_DIR"]) / f"gpus-{args.random_seed}"
record.write_text(os.environ.get("CUDA_VISIBLE_DEVICES", ""))

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

http.server.HTTPServer((args.host, int(args.port)), Health).serve_forever()
'''

DRIVER = '''
import json, os, sys
import ray
from relax_core.cluster.ray_compat import single_machine, without_dashboard_process, without_monitors
from relax_core.config import load_recipe
from relax_core.controller.engines import EngineSet, EngineSpec
from relax_core.controller.gpu_slots import GpuSlots
from relax_core.controller.workers import TrainerWorker
from relax_core.rollout.engine_command import EngineSettings

recipe = load_recipe(sys.argv[1], json.loads(sys.argv[2]))
single_machine(); without_dashboard_process(); without_monitors()
ray.init(num_cpus=2, num_gpus=int(sys.argv[3]), resources={"relax_train": 8, "relax_rollout": 8},
         include_dashboard=False, log_to_driver=False, configure_logging=False)
slots = GpuSlots.reserve(ray, recipe)
# as Job._create_trainers asks for them
trainer = ray.remote(max_concurrency=4)(TrainerWorker)
world = recipe.train_ranks
trainers = [trainer.options(**slots.trainer_options(r)).remote(r, world) for r in range(world)]
trainer_gpus = ray.get([t.__ray_call__.remote(lambda self: os.environ["CUDA_VISIBLE_DEVICES"]) for t in trainers])
ro = recipe.rollout
spec = EngineSpec(EngineSettings(ro.engine, "model", 0, 8, tp_size=max(ro.gpus_per_engine, 1)),
                  os.environ["RECORD_DIR"], "key")
engines = EngineSet(ray, spec, bucket_bytes=1 << 20, slots=slots)
urls = ray.get(engines.launch(ro.num_engines), timeout=120)
free_gpus = ray.available_resources().get("GPU", 0)
engines.stop()
for t in trainers:
    ray.kill(t)
slots.release()
print(json.dumps({"trainers": trainer_gpus, "engines": len(urls), "free_gpus": free_gpus}))
'''


def place(tmp_path: Path, overrides: list[str], gpus: int) -> tuple[dict, list[list[str]]]:
    """Run the driver on a Ray node with `gpus` GPUs; what the trainer ranks and each engine's server got."""
    fake = tmp_path / "fake" / "sglang"
    (fake / "srt").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "launch_server.py").write_text(textwrap.dedent(FAKE_SGLANG))
    (fake / "srt" / "server_args.py").write_text(  # no server argument of its own
        "_INPUT_NAMESPACES = []\nclass ServerArgs:\n    def add_cli_args(parser):\n        pass\n")
    (fake.parent / "sglang-0.0.dist-info").mkdir()
    (fake.parent / "sglang-0.0.dist-info" / "METADATA").write_text("Name: sglang\nVersion: 0.0\n")
    env = os.environ | {"PYTHONPATH": f"{fake.parent}:{REPO}", "RECORD_DIR": str(tmp_path),
                        "RELAX_NODE_IP": "127.0.0.1", "RAY_DEDUP_LOGS": "0"}
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(REPO / "recipes/math_dapo_qwen3_4b_fsdp.yaml"),
                           json.dumps(overrides), str(gpus)], capture_output=True, text=True, env=env, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    engines = [(tmp_path / f"gpus-{i}").read_text().split(",") for i in range(result["engines"])]
    return result, engines


@pytest.mark.full(covered_by="tests/unit/test_placement.py::"
                              "test_the_simulated_device_refuses_what_cuda_refuses")
def test_colocated_engines_share_the_trainer_ranks_gpus_within_the_node(tmp_path):
    """4 engines x TP 2 and 8 trainer ranks on a node of 8 GPUs (before: 8 + 4 x 2 = 16 asked of 8)."""
    result, engines = place(tmp_path, [], gpus=8)
    trainers = result["trainers"]
    assert sorted(trainers) == [str(gpu) for gpu in range(8)]  # one GPU each, every GPU of the node
    assert engines == [trainers[2 * j:2 * j + 2] for j in range(4)]  # engine j on trainer ranks 2j, 2j+1's GPUs
    assert result["free_gpus"] == 0


@pytest.mark.full(covered_by="tests/unit/test_placement.py::test_the_simulated_device_refuses_what_cuda_refuses")
def test_asynchronous_engines_get_gpus_of_their_own(tmp_path):
    result, engines = place(tmp_path, ["mode=fully_async", "cluster.rollout.nodes=1"], gpus=16)
    trainers = result["trainers"]
    assert len(set(trainers)) == 8 and all(len(engine) == 2 for engine in engines)
    held = [gpu for engine in engines for gpu in engine]
    assert sorted(trainers + held, key=int) == [str(gpu) for gpu in range(16)]  # nothing shared, nothing idle
    assert result["free_gpus"] == 0
