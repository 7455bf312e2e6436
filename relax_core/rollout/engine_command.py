"""The command line of an engine server: the one builder the runtime starts and the plan shows.

    recipe --rollout_engines / judge_engines--> EngineSettings --engine_command(settings, index, ...)--> argv

`EngineWorker` (controller/workers.py) starts `engine_command(...)` with the
node's address and a port (and, for an engine that serves on Relax's socket, its
file descriptor); `relax validate` (launch/plan.py) shows the same with
placeholders for them; tests/unit/test_sglang_engine.py holds it to golden files.
What differs between engine kinds is read from their spec (config/engines.py):
an SGLang engine binds the port it is given (`sglang_engine.server_command`),
the CPU engine serves on a socket Relax already listens on (`cpu_engine_command`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from relax_core.config.engines import engine_kind

if TYPE_CHECKING:
    from relax_core.config.schema import Recipe


@dataclass(frozen=True)
class EngineSettings:
    """What every engine of one set starts with; engine `index` differs only by its seed (`seed + index`)."""

    engine: str  # rollout.engine: the engine kind
    model_dir: str
    seed: int
    max_running_requests: int
    threads: int = 1  # torch threads (the CPU engine)
    trust_remote_code: bool = False  # the model directory's own code may run
    tp_size: int = 1  # GPUs (tensor-parallel ranks) of an engine on GPUs
    engine_args: dict[str, Any] = field(default_factory=dict)  # SGLang's server arguments (sglang_engine.server_args)
    video: dict[str, Any] = field(default_factory=dict)  # the CPU engine's video sampling (settings.engine_video)


def rollout_engines(recipe: Recipe, model_dir: str, threads: int) -> EngineSettings:
    """The settings of `recipe`'s rollout engines (`threads`: torch threads of each, as placement gives them)."""
    from relax_core.models.model_dir import trust_remote_code
    from relax_core.rollout.settings import engine_video
    from relax_core.rollout.sglang_engine import server_args

    ro = recipe.rollout
    return EngineSettings(ro.engine, model_dir, recipe.train.seed, ro.max_concurrency, threads,
                          trust_remote_code(recipe), max(ro.gpus_per_engine, 1), server_args(ro),
                          engine_video(recipe))


def judge_engines(recipe: Recipe, model_dir: str, threads: int) -> EngineSettings:
    """The settings of `recipe`'s judge engines (`reward.genrm`), the rollout's kind of engine serving the
    judge's model: with SGLang, servers of `rollout.gpus_per_engine` GPUs each (in the engines' group's last
    slots, placement.judge_slots) started with SGLang's defaults (the policy's `rollout.engine_args` tune its
    own engines); else CPU engines."""
    genrm, ro = recipe.reward.genrm, recipe.rollout
    if ro.gpus_per_engine:
        return EngineSettings(ro.engine, model_dir, recipe.train.seed, ro.max_concurrency, threads,
                              genrm.trust_remote_code, ro.gpus_per_engine)
    return EngineSettings("cpu", model_dir, recipe.train.seed, ro.max_concurrency, threads,
                          genrm.trust_remote_code)


def engine_command(settings: EngineSettings, index: int, *, python: str, host: str, port: int | str,
                   fd: int | str | None = None) -> list[str]:
    """The argv of engine `index` (its API key is not on it: the engine reads it from its environment).

    Args:
        python: the interpreter that runs the server.
        host, port: where it serves.
        fd: the socket it serves on, for a kind that does not bind its port itself.
    """
    s = settings
    common = dict(python=python, model_dir=s.model_dir, host=host, port=port, seed=s.seed + index,
                  max_running_requests=s.max_running_requests, trust_remote_code=s.trust_remote_code)
    if engine_kind(s.engine).binds_own_port:
        from relax_core.rollout.sglang_engine import INITIAL_WEIGHT_VERSION, server_command

        return server_command(tp_size=s.tp_size, weight_version=INITIAL_WEIGHT_VERSION,
                              engine_args=s.engine_args, **common)
    return cpu_engine_command(fd=fd, threads=s.threads, video=s.video, **common)


def cpu_engine_command(*, python: str, model_dir: str, host: str, port: int | str, fd: int | str | None,
                       threads: int, seed: int, max_running_requests: int, trust_remote_code: bool,
                       video: dict | None = None) -> list[str]:
    """The argv of one CPU engine server (`fd`: its listening socket; the API key is in its environment;
    `video`: the data set's `video_fps` / `video_min_frames` / `video_max_frames`)."""
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in (video or {}).items()]
    return [
        python, "-m", "relax_core.rollout.cpu_engine", "--model-path", model_dir, "--host", host,
        "--port", str(port), "--fd", str(fd), "--num-threads", str(threads),
        "--seed", str(seed), "--max-running-requests", str(max_running_requests), "--weight-version", "0",
    ] + (["--trust-remote-code"] if trust_remote_code else []) + flags
