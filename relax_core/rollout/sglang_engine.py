"""SGLang engines: the command line of one `sglang.launch_server` and the check of `rollout.engine_args`.

An engine of `rollout.engine: sglang` is SGLang's own HTTP server on the GPUs
Ray gave its actor (rollout/engine_worker.py starts it, with the command line
rollout/engine_command.py builds from `server_command`). Relax sets the flags
it owns (model, host, port, TP size, seed, request limit, weight version,
remote code, deterministic inference from `rollout.deterministic`) and appends
the recipe's `rollout.engine_args`, turned into flags the way SGLang's argparse
reads them:

    {mem_fraction_static: 0.7}      -> --mem-fraction-static 0.7
    {enable_memory_saver: true}     -> --enable-memory-saver   (false: omitted)
    {enable_tf32_matmul: false}     -> --no-enable-tf32-matmul (a --x/--no-x flag)
    {cuda_graph_bs_decode: [1, 2]}  -> --cuda-graph-bs-decode 1 2
    {json_model_override_args: {}}  -> --json-model-override-args '{}'

Each key is checked (at validate time) against SGLang's server arguments:
the installed SGLang's, read from its source without importing it
(`sglang_source.py`), or, where SGLang is not installed, the list kept for the
pinned version (`sglang_server_args.py`).

The API key is not on the command line (any user can read /proc/*/cmdline):
SGLang reads it only from `--api-key`, so the server is started through
`sglang_launch`, which adds the flag from the environment in-process.
"""

from __future__ import annotations

import difflib
import json
from functools import cache
from typing import Any

LAUNCHER = "relax_core.rollout.sglang_launch"
INITIAL_WEIGHT_VERSION = "0"  # the model directory's weights; each weight sync sets the step it carries

# SGLang's server arguments Relax sets itself, and what it sets each from.
RESERVED = {
    "model_path": "model.path",
    "host": "the node's cluster address",
    "port": "a free port of the node",
    "tp_size": "rollout.gpus_per_engine",
    "api_key": "the run's secret engine key",
    "random_seed": "train.seed (plus the engine's index)",
    "max_running_requests": "rollout.max_concurrency",
    "weight_version": "the weight sync",
    "trust_remote_code": "model.trust_remote_code",
    "config": "the recipe (a config file would bypass this check: put its options in rollout.engine_args)",
    "enable_deterministic_inference": "rollout.deterministic",
}

# SGLang server arguments that change how many processes (GPUs) an engine runs, or which GPUs they take.
# The weight-update group gives each engine `rollout.gpus_per_engine` ranks: SGLang joins it from every
# scheduler process as `rank_offset + tp_rank` (srt/model_executor/model_runner_components/weight_updater.py,
# `init_weights_update_group`), so data-parallel replicas or pipeline stages would join with the same ranks,
# and Ray gives each engine exactly its TP size in GPUs. Each maps to what to set instead.
ENGINE_LAYOUT = {
    "dp_size": "rollout.num_engines (each engine is one replica, behind the router), or attn_dp_size for "
               "data-parallel attention inside one engine's tensor-parallel group",
    "pp_size": "rollout.gpus_per_engine (tensor parallelism) for a model one GPU cannot hold",
    "enable_dp_attention": "attn_dp_size (data-parallel attention inside the engine's tensor-parallel group, "
                           "which keeps its GPU count; SGLang 0.5.23 deprecates --enable-dp-attention)",
    "nnodes": "rollout.gpus_per_engine at most one node's GPUs (an engine runs on one node), and more engines",
    "node_rank": "rollout.gpus_per_engine at most one node's GPUs (an engine runs on one node), and more engines",
    "dist_init_addr": "nothing: an engine runs on one node, and Relax picks its ports",
    "base_gpu_id": "nothing: Ray gives each engine its GPUs",
    "gpu_id_step": "nothing: Ray gives each engine its GPUs",
}


def server_command(*, python: str, model_dir: str, host: str, port: int, tp_size: int, seed: int,
                   max_running_requests: int, weight_version: str, engine_args: dict[str, Any],
                   trust_remote_code: bool) -> list[str]:
    """The argv of one SGLang engine (without its API key, which `sglang_launch` adds from the environment).

    `engine_args` have passed `engine_args_problems` at submit; their flags are those of the SGLang
    installed here (the pinned list where there is none)."""
    command = [
        python, "-m", LAUNCHER, "--model-path", model_dir, "--host", host, "--port", str(port),
        "--tp-size", str(tp_size), "--random-seed", str(seed), "--max-running-requests", str(max_running_requests),
        "--weight-version", weight_version,
    ] + (["--trust-remote-code"] if trust_remote_code else [])
    version, table = server_arg_table()
    for key, value in engine_args.items():
        if key not in table:  # checked at submit against another SGLang than the one installed here
            raise ValueError(f"rollout.engine_args.{key}: not a server argument of SGLang {version}, the one "
                             f"installed where this engine starts")
        command += _flags(table[key], value)
    return command


def server_args(rollout) -> dict[str, Any]:
    """The server arguments of each engine of a `RolloutConfig`: its `engine_args`, and with `deterministic`
    SGLang's deterministic inference, the only mode in which SGLang samples by a request's `sampling_seed`
    (without it `SamplingBatchInfo.from_schedule_batch` builds no seed tensor and the sampler draws from
    the device's generator: srt/sampling/sampling_batch_info.py)."""
    return dict(rollout.engine_args) | ({"enable_deterministic_inference": True} if rollout.deterministic else {})


def _flags(arg: tuple[str, str], value: Any) -> list[str]:
    """One engine argument as SGLang's argparse reads it (`arg`: its flag and kind)."""
    flag, kind = arg
    if kind in ("flag", "flag_on"):
        return [flag] if value else []
    if kind == "bool":
        return [flag] if value else ["--no-" + flag[2:]]
    if kind == "list":
        return [flag, *(_text(v) for v in (value if isinstance(value, list) else [value]))]
    return [flag, _text(value)]


def _text(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)


def engine_args_problems(engine_args: dict[str, Any]) -> list[str]:
    """What is wrong with `rollout.engine_args` for SGLang (empty: nothing)."""
    version, table = server_arg_table()
    problems = []
    for key, value in engine_args.items():
        field = f"rollout.engine_args.{key}"
        if key in RESERVED:
            problems.append(f"{field}: Relax sets it from {RESERVED[key]}; remove it from rollout.engine_args")
        elif key in ENGINE_LAYOUT:
            problems.append(f"{field}: it changes how many GPUs (ranks) an engine has, and the weight sync gives "
                            f"each engine rollout.gpus_per_engine ranks, one per tensor-parallel GPU; remove it "
                            f"and set {ENGINE_LAYOUT[key]}")
        elif key not in table:
            close = difflib.get_close_matches(key, list(table), n=3)
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            problems.append(f"{field}: not a server argument of SGLang {version}{hint}")
        else:
            problems += _value_problems(field, table[key], value)
    return problems


def _value_problems(field: str, arg: tuple[str, str], value: Any) -> list[str]:
    flag, kind = arg
    if value is None:
        return [f"{field}: null; remove the key to keep SGLang's default"]
    if kind in ("flag", "flag_on", "bool") and not isinstance(value, bool):
        return [f"{field}: {flag} is an on/off flag; set true or false (got {value!r})"]
    if kind == "flag_on" and not value:
        return [f"{field}: {flag} is on by default and SGLang has no flag to turn it off; remove the key"]
    return []


@cache
def server_arg_table() -> tuple[str, dict[str, tuple[str, str]]]:
    """SGLang's version and its server arguments `{name: (flag, kind)}`: the installed SGLang's, read from
    its source, else the list kept for the pinned version."""
    from relax_core.rollout import sglang_source

    installed = sglang_source.installed()
    if installed is not None:
        return installed
    from relax_core.rollout.sglang_server_args import SERVER_ARGS, SGLANG_VERSION

    return SGLANG_VERSION, SERVER_ARGS
