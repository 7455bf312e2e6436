"""Where a run stands: the last completed step with its prompt cursor, the newest checkpoint, and the
checkpoints of every trainer rank that record them.

The training loops (`colocate.py`, `streaming.py`) say when a step is complete (`step_done`) and when to
save (`checkpoint`); a stop saves the last completed step (`stop_here`); a run that starts again loads the
newest save (`resume`, through `Job.resume`, which also gives the engines the loaded weights).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from relax_core.checkpoint import find_latest
from relax_core.checkpoint.owner import claim
from relax_core.config.same_run import fingerprint
from relax_core.config.schema import Recipe
from relax_core.rundir import RunDir

log = logging.getLogger("relax_core.controller.job")


class Progress:
    """Args:
        trainers: the trainer ranks' actors (each saves and loads its own part).
        prompts: the prompt source, whose cursor a checkpoint records.
        engines_added: how many engines the run's scale-outs started and still run (a checkpoint records
            it, and a resumed run asks for them again).
        notifier: the run's `metrics.notify.Notifier`, told of each checkpoint (None: nobody).
        restarted: this job replaces one that failed: it resumes from the run's newest checkpoint even
            where `checkpoint.resume` is off (that is about checkpoints of earlier runs).
    """

    def __init__(self, ray, recipe: Recipe, run: RunDir, trainers: list, prompts,
                 engines_added: Callable[[], int], notifier=None, restarted: bool = False):
        self._ray, self.recipe, self.run, self.trainers, self.prompts = ray, recipe, run, trainers, prompts
        self.engines_added, self.notifier, self.restarted = engines_added, notifier, restarted
        self.ckpt_dir = str(run.checkpoint_dir(recipe))
        self.completed: tuple[int, dict] = (0, {})  # the last completed step and its prompt cursor
        self.checkpointed = 0  # the newest step with a checkpoint

    def checkpoint(self, step: int, data_state: dict | None = None) -> None:
        """Save every rank's state; `data_state`: the prompt cursor as of this step (when rollout runs ahead)."""
        data = data_state if data_state is not None else self.prompts.state_dict()
        progress = {"step": step, "data": data, "policy_version": step, "engines_added": self.engines_added()}
        keep = self.recipe.checkpoint.keep_last
        self._ray.get([t.save_checkpoint.remote(self.ckpt_dir, step, progress, keep) for t in self.trainers])
        self.checkpointed = step
        self.run.update_state(checkpoint_step=step)
        if self.notifier is not None:
            self.notifier.checkpoint(step, self.ckpt_dir)

    def step_done(self, step: int, data_state: dict | None = None) -> None:
        """`step` is complete: a stop from now on checkpoints it, with the prompt cursor as of its end
        (`data_state`, when rollout runs ahead; else the cursor now, before the next step takes prompts)."""
        self.completed = (step, dict(data_state if data_state is not None else self.prompts.state_dict()))

    def stop_here(self) -> str:
        """The run was told to stop: checkpoint the last completed step (unless it already is); the
        partial step's samples are dropped and a resumed run regenerates them."""
        step, data_state = self.completed
        if step > self.checkpointed:
            self.checkpoint(step, data_state)
        log.info("stopping: step %d is the last completed one", step)
        return "stopped"

    def resume(self, resync: Callable[[int], object]) -> tuple[int, int]:
        """Load the newest checkpoint, if any, and give the engines its weights (`resync(version)`);
        returns the last completed step and the engines the run's scale-outs had added then.

        The checkpoint directory must be this run's own (it is claimed on first use), and what an
        interrupted attempt logged after the checkpoint is dropped: those steps run again.
        """
        claim(self.ckpt_dir, self.run.run_id(), self.run.path, fingerprint(self.recipe.model_dump(mode="json")))
        if not ((self.recipe.checkpoint.resume or self.restarted) and find_latest(self.ckpt_dir) is not None):
            return 0, 0
        progress = self._ray.get([t.load_checkpoint.remote(self.ckpt_dir) for t in self.trainers])[0]
        self.prompts.load_state_dict(progress["data"])
        resync(int(progress["policy_version"]))
        log.info("resumed from %s at step %d", self.ckpt_dir, progress["step"])
        self.checkpointed = int(progress["step"])
        self.completed = (self.checkpointed, dict(progress["data"]))
        return self.checkpointed, int(progress.get("engines_added", 0))
