"""The plan of a run: which node group and which GPUs (or cores) run which process, and whether they fit.

    layout    which GPU of which node a trainer rank / an engine gets, and each process's threads:
              cluster/placement.py computes it, controller/gpu_slots.py makes Ray keep to it, and
              this module shows it
    check     resource_problems               a recipe never asks for more GPUs than its groups have
    show      plan_lines                      `relax validate` and `relax submit --dry-run` print it

The rules, one node group at a time:

    trainer ranks   cluster.train.nodes x gpus_per_node, one per GPU (on CPU: x train.cpu_ranks_per_node)
    engines         on the rollout group, or (colocate without one) on the train group's GPUs, time-shared
                    with the trainer ranks (an engine releases its memory while they train); an engine's
                    rollout.gpus_per_engine GPUs (its tensor-parallel ranks) are on one node, so a node of
                    G GPUs holds G // gpus_per_engine engines, and the group nodes x that many
    services        (fully_async, hybrid) the rollout and advantage services beside engine 0, on the CPU
                    (services/launch.py); one reference worker per GPU of `cluster.reference` (per node
                    of a CPU group); the critic and, without a reference group, the reference model
                    live in the trainer ranks (their rows say so)

The plan is computed from the recipe alone (no Ray, no torch), so it is the
same on the login node and in tests; values only known when a process starts
are placeholders (`<node-ip>`, `<port>`). GPU indices are positions on a node;
Ray binds each to a physical GPU when the run starts, the same one for every
process the plan puts on it.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from relax_core.cluster.placement import (
    engine_slot_gpus,
    engine_slots,
    engines_per_node,
    engines_share_train_gpus,
    judge_slots,
    local_cpu_sets,
    threads_per_process,
    trainer_gpu,
)
from relax_core.config.model import HFModel, TinyModel
from relax_core.config.modes import advantage_service, mode_spec, reference_service
from relax_core.config.schema import Recipe, rollout_group_name
from relax_core.launch.executors import Executor, executor_named

_PLACEHOLDER = re.compile(r"'(<[\w-]+>[\w./-]*)'")  # shlex quotes `<port>`; the plan shows it bare


# ------------------------------------------------------------------- check
def resource_problems(recipe: Recipe) -> list[str]:
    """GPU engines that do not fit their group, with the arithmetic (trainer ranks fit by construction)."""
    ro, name = recipe.rollout, rollout_group_name(recipe)
    group, tp = getattr(recipe.cluster, name), ro.gpus_per_engine
    if not tp:
        return []
    engines = f"{ro.num_engines} engine{_s(ro.num_engines)} x {tp} GPU{_s(tp)} = {ro.num_engines * tp} GPUs"
    if not group.gpus_per_node:
        return [f"cluster.{name}.gpus_per_node: {engines}, but the {name} group has no GPUs; "
                f"set cluster.{name}.gpus_per_node"]
    if tp > group.gpus_per_node:
        return [f"rollout.gpus_per_engine: an engine's {tp} GPUs (its tensor-parallel ranks) must be on one node, "
                f"but a node of the {name} group has {group.gpus_per_node}; lower rollout.gpus_per_engine to "
                f"{group.gpus_per_node} or raise cluster.{name}.gpus_per_node to {tp}"]
    judges = recipe.reward.judge_engines
    if judges and engines_share_train_gpus(recipe):
        return ["reward.genrm: judge engines on GPUs need GPUs of their own, and here the engines share the "
                "trainer ranks' GPUs (colocate); give the rollout a node group of its own "
                "(cluster.rollout with GPUs, mode hybrid or fully_async), or serve the judge yourself at "
                "$RELAX_GENRM_URL and drop reward.genrm"]
    per_node, slots = engines_per_node(recipe), engine_slots(recipe)
    capacity = slots - judges
    if ro.num_engines <= capacity:
        return []
    if judges:
        engines += f", and {judges} judge engine{_s(judges)} (reward.genrm) x {tp} GPU{_s(tp)} = {judges * tp} GPUs"
    shared = " (colocate: the engines share the trainer ranks' GPUs)" if engines_share_train_gpus(recipe) else ""
    partial = (f", and a node's {group.gpus_per_node} GPUs hold {per_node} engine{_s(per_node)} of {tp}"
               if group.gpus_per_node % tp else "")
    lower = f" or lower rollout.num_engines to {capacity}" if capacity > 0 else ""
    return [f"cluster.{name}: {engines}, but the {name} group has {_nodes(group.nodes)} x {group.gpus_per_node} "
            f"GPUs = {group.gpus}{shared}{partial}; raise cluster.{name}.nodes to "
            f"{math.ceil((ro.num_engines + judges) / per_node)}{lower}"]


def _s(count: int) -> str:
    return "" if count == 1 else "s"


def _nodes(count: int) -> str:
    return f"{count} node{_s(count)}"


# -------------------------------------------------------------------- show
@dataclass(frozen=True)
class Row:
    """One process and where it runs."""

    group: str
    node: int | None  # index in the group; None: any of its nodes (Ray picks one with a free slot)
    devices: str
    process: str


class _Planner:
    """The rows and engine command lines of one recipe on one executor."""

    def __init__(self, recipe: Recipe, executor: Executor):
        self.recipe, self.here = recipe, executor.on_this_machine
        self.cpu_sets = local_cpu_sets(recipe) if self.here else {}  # each group pinned to its own cores

    def threads(self, group: str) -> int:
        """Torch threads of a trainer rank or CPU engine of `group` (controller/job.py gives them the same)."""
        node, pinned = getattr(self.recipe.cluster, group), self.cpu_sets.get(group)
        cores = min(len(pinned or ()) or node.cpus_per_node, os.cpu_count() or 1) if self.here else node.cpus_per_node
        return threads_per_process(self.recipe, group, cores)

    def cpu(self, group: str, threads: int | None = None, cores: list[int] | None = None) -> str:
        threads = threads or self.threads(group)
        cores = cores if cores is not None else self.cpu_sets.get(group)
        return f"CPU ({_span('core', cores) + ', ' if cores else ''}{threads} thread{_s(threads)})"

    def rows(self) -> list[Row]:
        rows = self.trainers() + self.engines() + self.judges()
        if mode_spec(self.recipe.mode).rollout_service:
            rows += self.services() + self.transfer_queue()
        return rows + [self.driver()]

    def trainers(self) -> list[Row]:
        r = self.recipe
        models = [name for name, on in (("the critic", r.algorithm.spec.needs_critic),
                                         ("the reference model", r.algorithm.uses_reference
                                          and not reference_service(r)),
                                         ("the teacher", r.algorithm.spec.needs_teacher)) if on]
        what = r.train.backend + (f", with {' and '.join(models)}" if models else "")
        names = [f"trainer rank {rank} ({what})" for rank in range(r.train_ranks)]
        if r.cluster.train.gpus_per_node:
            return [Row("train", *_gpu(trainer_gpu(r, rank)), name) for rank, name in enumerate(names)]
        return [Row("train", _only(r.cluster.train.nodes), self.cpu("train"), name) for name in names]

    def engines(self) -> list[Row]:
        r = self.recipe
        ro, group = r.rollout, rollout_group_name(r)
        if not ro.gpus_per_engine:
            where = _only(getattr(r.cluster, group).nodes)
            return [Row(group, where, self.cpu(group), f"engine {i} ({ro.engine})") for i in range(ro.num_engines)]
        rows = []
        for i in range(ro.num_engines):
            node, gpus = engine_slot_gpus(r, i)
            what = f"engine {i} ({ro.engine}, TP {ro.gpus_per_engine})"
            if engines_share_train_gpus(r):
                ranks = [node * r.cluster.train.gpus_per_node + gpu for gpu in gpus]
                what += f" on the GPUs of {_span('trainer rank', ranks)}, its memory released while they train"
            rows.append(Row(group, node, _span("GPU", gpus), what))
        return rows

    def judges(self) -> list[Row]:
        """The judge engines of `reward.genrm`: the engines' group's last GPU slots (SGLang), else CPU engines."""
        r, group = self.recipe, rollout_group_name(self.recipe)
        on_gpus = judge_slots(r)
        if on_gpus:
            tp = r.rollout.gpus_per_engine
            return [Row(group, node, _span("GPU", gpus), f"judge engine {i} ({r.rollout.engine}, TP {tp}, "
                        "reward.genrm.model)")
                    for i, (node, gpus) in enumerate(engine_slot_gpus(r, slot) for slot in on_gpus)]
        where = _only(getattr(r.cluster, group).nodes)
        return [Row(group, where, self.cpu(group), f"judge engine {i} (cpu engine, reward.genrm.model)")
                for i in range(r.reward.judge_engines)]

    def services(self) -> list[Row]:
        """What services/launch.py starts in the asynchronous modes, and beside which process."""
        r = self.recipe
        engine0 = self.engines()[0]
        near_engines = (engine0.group, engine0.node, self.cpu(engine0.group, threads=1))
        rows = [Row(*near_engines, "rollout service (beside engine 0)")]
        if reference_service(r):
            rows += self.reference_workers()
        if advantage_service(r):
            rows.append(Row(*near_engines, "advantage service (beside engine 0)"))
        return rows

    def reference_workers(self) -> list[Row]:
        """One per GPU of `cluster.reference`, or one per node of a CPU group (services/launch.py)."""
        own, pinned = self.recipe.cluster.reference, self.cpu_sets.get("reference")
        if own.gpus_per_node:
            return [Row("reference", node, f"GPU {gpu}", f"reference worker {node * own.gpus_per_node + gpu}")
                    for node in range(own.nodes) for gpu in range(own.gpus_per_node)]
        cpu = self.cpu("reference", threads=len(pinned) if pinned else own.cpus_per_node)
        return [Row("reference", i, cpu, "reference worker") for i in range(own.nodes)]

    def transfer_queue(self) -> list[Row]:
        nodes = self.recipe.cluster.train.nodes
        return [Row("train", 0, "CPU (1 Ray CPU)", "TransferQueue controller")] + [
            Row("train", i, "CPU (1 Ray CPU)", "TransferQueue storage unit") for i in range(nodes)]

    def driver(self) -> Row:
        ro = self.recipe.rollout
        router = f"; router (sglang-router) in front of the {ro.num_engines} engines" if ro.uses_router else ""
        return Row("train", 0, "CPU", f"driver{router}")

    def commands(self, python: str) -> list[tuple[str, list[str]]]:
        """(name, argv) of every engine server the run starts: the rollout engines, then the judge's, as
        `EngineWorker` builds them (rollout/engine_command.py)."""
        from relax_core.rollout.engine_command import engine_command, judge_engines, rollout_engines

        r = self.recipe
        threads = self.threads(rollout_group_name(r))
        where = {"python": python, "host": "<node-ip>", "port": "<port>", "fd": "<fd>"}
        engines = rollout_engines(r, _model_dir_of(r)[0], threads)
        commands = [(f"engine {i}", engine_command(engines, i, **where)) for i in range(r.rollout.num_engines)]
        if r.reward.judge_engines:
            judges = judge_engines(r, _judge_dir(r.reward.genrm.model), threads)
            commands += [(f"judge engine {i}", engine_command(judges, i, **where))
                         for i in range(r.reward.judge_engines)]
        return commands

def _gpu(where: tuple[int, int]) -> tuple[int, str]:
    return where[0], f"GPU {where[1]}"


def _only(nodes: int) -> int | None:
    """Node 0 of a one-node group; None (any node, Ray's pick) otherwise."""
    return 0 if nodes == 1 else None


def _span(what: str, numbers: list[int]) -> str:
    """`GPU 3`, `GPUs 2-3`, `cores 0,2`: consecutive numbers as a range."""
    numbers = sorted(numbers)
    plural = what + ("s" if len(numbers) > 1 else "")
    if len(numbers) > 1 and numbers == list(range(numbers[0], numbers[-1] + 1)):
        return f"{plural} {numbers[0]}-{numbers[-1]}"
    return f"{plural} {','.join(map(str, numbers))}"


def _group_lines(recipe: Recipe) -> list[str]:
    """Each node group's size and what takes its GPUs (or cores), with the arithmetic."""
    cluster, ro = recipe.cluster, recipe.rollout
    engines_on = rollout_group_name(recipe)
    lines = []
    for name in cluster.groups:
        group = getattr(cluster, name)
        size = (f"{_nodes(group.nodes)} x {group.gpus_per_node} GPUs = {group.gpus} GPUs" if group.gpus_per_node
                else f"{_nodes(group.nodes)} x {group.cpus_per_node} core{_s(group.cpus_per_node)}, no GPU")
        uses = []
        if name == "train":
            per = ("one per GPU" if group.gpus_per_node
                   else f"train.cpu_ranks_per_node={recipe.train_ranks // group.nodes}")
            if getattr(recipe.train, "model_parallel", 1) > 1:
                per += (f"; tensor x pipeline x context parallel = {recipe.train.model_parallel}: "
                        f"{recipe.data_parallel} data-parallel")
            uses.append(f"{recipe.train_ranks} trainer rank{_s(recipe.train_ranks)} ({per})")
        if name == engines_on:
            judges = len(judge_slots(recipe))
            used = ro.num_engines * ro.gpus_per_engine
            what = f"{ro.num_engines} engine{_s(ro.num_engines)}"
            what += f" x {ro.gpus_per_engine} GPU{_s(ro.gpus_per_engine)} = {used} GPUs" if used else " (CPU)"
            used += judges * ro.gpus_per_engine
            if engines_share_train_gpus(recipe):
                what += " on the trainer ranks' GPUs (colocate: time-shared)"
            elif ro.gpus_per_engine and group.gpus > used:
                what += f", {group.gpus - used} GPUs idle"
            uses.append(what)
            if judges:
                uses.append(f"{judges} judge engine{_s(judges)} x {ro.gpus_per_engine} "
                            f"GPU{_s(ro.gpus_per_engine)} (reward.genrm)")
            elif recipe.reward.judge_engines:
                uses.append(f"{recipe.reward.judge_engines} judge engine{_s(recipe.reward.judge_engines)} (CPU)")
        if name == "reference":
            workers = group.nodes * (group.gpus_per_node or 1)
            uses.append(f"{workers} reference worker{_s(workers)} "
                        f"({'one per GPU' if group.gpus_per_node else 'one per node, CPU'})")
        lines.append(f"cluster.{name}: {size}: {', '.join(uses)}")
    return lines


def _model_dir_of(recipe: Recipe) -> tuple[str, list[str]]:
    """The model directory the engines load, as the plan writes it, and what its placeholder means."""
    model = recipe.model
    if isinstance(model, TinyModel) or (isinstance(model, HFModel) and model.tokenizer):
        return "<run-dir>/model", []
    assert isinstance(model, HFModel)
    local = Path(model.path).expanduser()
    if local.is_dir():
        return str(local.resolve()), []
    return "<model-dir>", [f"<model-dir>: the hub snapshot of {model.path} (fetched once)"]


def _judge_dir(model: str) -> str:
    local = Path(model).expanduser()
    return str(local.resolve()) if local.is_dir() else "<judge-model-dir>"


def plan_lines(recipe: Recipe, executor: str, python: str | None = None, run_dir: str | None = None) -> list[str]:
    """The plan as printed: the groups' arithmetic, one line per process, the engine command lines, the
    memory plan of each GPU (`memory.py`).

    Args:
        executor: the executor's name (launch/executors.py), which says where the node groups run.
        python: the interpreter the command lines name (default: this one).
        run_dir: the run directory, when known (else `<run-dir>`).
    """
    chosen = executor_named(executor)
    where, notes = chosen.placement(recipe)
    lines = [f"plan: {recipe.mode} on the {executor} executor ({where})"] + [f"  {note}" for note in notes]
    lines += [f"  {line}" for line in _group_lines(recipe)]
    planner = _Planner(recipe, chosen)
    for row in planner.rows():
        where = f"{row.group}[{'*' if row.node is None else row.node}]"
        lines.append(f"  {where:<13} {row.devices:<28} {row.process}")
    lines.append("engine command lines (<node-ip>, <port>, <fd>: set when the engine starts; "
                 "its API key is in its environment):")
    for name, argv in planner.commands(python or sys.executable):
        lines.append(f"  {name}: {_PLACEHOLDER.sub(lambda m: m[1], shlex.join(argv))}")
    from relax_core.launch.memory import memory_lines

    legend = _model_dir_of(recipe)[1]
    if recipe.reward.judge_engines and _judge_dir(recipe.reward.genrm.model).startswith("<"):
        legend.append(f"<judge-model-dir>: the hub snapshot of {recipe.reward.genrm.model} (fetched once)")
    text = "\n".join(lines + [f"  {item}" for item in legend] + memory_lines(recipe))
    return (text.replace("<run-dir>", run_dir) if run_dir else text).splitlines()
