"""Services that add a column to each step's rows: reference and current-policy log-probs, advantages.

    rollout service: partition s is in TransferQueue  ->  worker.process(s, rows)
        worker: claim `rows` rows it has not processed, read only its input columns,
                compute, write its column on the same rows      (returns the number of rows)
    driver: waits for those calls, then claims the complete rows for the trainer ranks

`ReferenceWorker` holds the frozen reference model (the initial policy) and
writes `ref_logprobs`, one log-prob per response token, exactly what the
trainer's own reference forward would give (the same packing and forward,
train/batching.py). `ActorForwardWorker` holds a copy of the policy, gets the
actor's weights after every optimizer step (from trainer rank 0, like the
engines) and writes `old_logprobs`: the proximal policy's log-prob of every
response token, which the trainer would otherwise recompute before its first
update (several updates per step, or an estimator that reads them). It uses
the newest version it has, never one older than the version that generated
the rows, so with `max_staleness: 0` its log-probs are exactly the trainer's
own (the weights the step starts from). `AdvantageWorker` runs an outcome estimator (one whose
spec says `outcome_only`: rewards and group ids suffice) over the whole step
and writes `advantages`, one per row. Several reference workers share a
partition (each takes its share of rows); the advantage worker takes the
whole step at once, as group baselines and whitening need.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from relax_core.models.multimodal import pad_token_id
from relax_core.rollout.types import Sample

REFERENCE_COLUMN, ADVANTAGE_COLUMN, OLD_LOGP_COLUMN = "ref_logprobs", "advantages", "old_logprobs"
WEIGHTS_WAIT_S = 600.0  # an actor-forward worker waits this long for the weights its rows need


class _FieldWorker:
    """Common part: cores, threads, the bus, and `process`."""

    consumer: str
    inputs: tuple[str, ...]
    output: str

    def __init__(self, threads: int, cpus: list[int] | None):
        import torch

        from relax_core.controller.workers import pin_process
        from relax_core.data.bus import import_tq

        if cpus:
            pin_process(cpus)
        torch.set_num_threads(threads)
        import_tq()  # now, while the job starts, not in the first step
        self.bus = None  # TransferQueue, attached on the first step (it starts while the models load)
        self._attaching = threading.Lock()  # a threaded worker's first calls may come together
        self.rows = 0  # processed so far (tests and logs)

    def node_id(self) -> str:
        from relax_core.services.placement import node_id

        return node_id()

    def process(self, step: int, rows: int) -> int:
        """Add this service's column to `rows` rows of step `step` (all there: the rollout put them)."""
        return self._process(step, rows, self.compute)

    def _process(self, step: int, rows: int, compute: Callable[[dict[str, list]], list]) -> int:
        done = self._bus().process(step, self.consumer, self.inputs, self.output, compute, rows)
        self.rows += done
        return done

    def _bus(self):
        with self._attaching:  # TransferQueue's client is one per process, made by the first attach
            if self.bus is None:
                from relax_core.data.bus import SampleBus

                self.bus = SampleBus.attach()
        return self.bus

    def compute(self, columns: dict[str, list]) -> list:
        raise NotImplementedError

    def close(self) -> None:
        if self.bus is not None:
            self.bus.close()


class ReferenceWorker(_FieldWorker):
    """Log-probs of every response token under the frozen reference model."""

    consumer, inputs, output = "reference", ("prompt_ids", "response_ids", "multimodal"), REFERENCE_COLUMN

    def __init__(self, model_dir: str, dtype: str, micro_batch_size: int, threads: int = 1,
                 cpus: list[int] | None = None, trust_remote_code: bool = False):
        super().__init__(threads, cpus)
        from relax_core.train.torch_backend import load_causal_lm

        self.model = load_causal_lm(model_dir, dtype, "cpu", trust_remote_code).requires_grad_(False)
        self.pad_id = pad_token_id(self.model)
        self.micro_batch_size = micro_batch_size

    def compute(self, columns: dict[str, list]) -> list[list[float]]:
        return token_logprobs(self.model, self.pad_id, self.micro_batch_size, columns)


class ActorForwardWorker(ReferenceWorker):
    """Log-probs of every response token under the current policy, as of the newest weights received.

    A threaded actor: `set_weights` arrives while `process` waits for a version new enough.
    """

    consumer, inputs, output = "actor_forward", ("prompt_ids", "response_ids", "multimodal", "policy_version"), \
        OLD_LOGP_COLUMN

    def __init__(self, model_dir: str, dtype: str, micro_batch_size: int, threads: int = 1,
                 cpus: list[int] | None = None, trust_remote_code: bool = False, version: int = 0,
                 frozen: tuple[bool, bool] = (False, False)):
        """`frozen`: the trainer's (`freeze_vision`, `freeze_audio`); the actor's weights then come without
        those encoders, which stay as the model directory has them here too."""
        super().__init__(model_dir, dtype, micro_batch_size, threads, cpus, trust_remote_code)
        self.frozen: set[str] = set()
        if any(frozen):
            from relax_core.models.multimodal import freeze

            self.frozen = set(freeze(self.model, vision=frozen[0], audio=frozen[1]))
        self.version = version  # of the weights held: the model directory's are the run's start
        self.versions_used: dict[int, int] = {}  # step -> version its log-probs came from (tests, logs)
        self._cond = threading.Condition()
        self._closed = False

    def set_weights(self, weights: tuple[int, list]) -> int:
        """Take the actor's weights `(version, [(name, tensor), ...])` unless newer ones are held;
        returns the version now held."""
        version, named = weights
        with self._cond:
            if version > self.version:
                state = dict(named)
                missing = [name for name, _ in self.model.named_parameters()
                           if name not in state and name not in self.frozen]
                if missing:
                    raise ValueError(f"actor weights of version {version} lack {missing[:3]}")
                self.model.load_state_dict(state, strict=False)
                self.version = version
            self._cond.notify_all()
            return self.version

    def process(self, step: int, rows: int) -> int:
        def compute(columns: dict[str, list]) -> list[list[float]]:
            logprobs, self.versions_used[step] = self.forward(columns)
            return logprobs

        return self._process(step, rows, compute)

    def forward(self, columns: dict[str, list]) -> tuple[list[list[float]], int]:
        """The log-probs of the rows and the weights' version, once it is at least the rows' own."""
        from relax_core.data.bus import scalar

        needed = max(int(scalar(v)) for v in columns["policy_version"])
        with self._cond:  # no weights change during the forward
            if not self._cond.wait_for(lambda: self.version >= needed or self._closed, timeout=WEIGHTS_WAIT_S):
                raise TimeoutError(f"actor-forward: weights of version {needed} (the rows' own) never came; "
                                   f"holding version {self.version}")
            return token_logprobs(self.model, self.pad_id, self.micro_batch_size, columns), self.version

    def used(self) -> dict[int, int]:
        return dict(self.versions_used)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        super().close()


def token_logprobs(model, pad_id: int, micro_batch_size: int, columns: dict[str, list]) -> list[list[float]]:
    """`model`'s log-prob of every response token of the rows (`prompt_ids`, `response_ids` and, for
    rows with media, `multimodal` columns), packed and run as the trainer does (train/batching.py)."""
    import torch

    from relax_core.train.batching import chunks, forward_logprobs, pack

    media = columns.get("multimodal") or [None] * len(columns["prompt_ids"])
    rows = [Sample(prompt_ids=p, response_ids=r, rollout_logprobs=[], multimodal=m)
            for p, r, m in zip(columns["prompt_ids"], columns["response_ids"], media)]
    out: list[list[float]] = []
    with torch.no_grad():
        for part in chunks(rows, micro_batch_size):
            mb = pack(part, pad_id)
            out += mb.response_lists(forward_logprobs(model, mb)[0])
    return out


class AdvantageWorker(_FieldWorker):
    """One advantage per row from the step's rewards and group ids (outcome estimators)."""

    consumer, inputs, output = "advantages", ("reward", "group_id"), ADVANTAGE_COLUMN

    def __init__(self, estimator: str, kwargs: dict, cpus: list[int] | None = None):
        super().__init__(1, cpus)
        self.advantages = outcome_advantages(estimator, kwargs)

    def compute(self, columns: dict[str, list]) -> list[float]:
        from relax_core.data.bus import scalar

        return self.advantages([float(scalar(v)) for v in columns["reward"]],
                               [int(scalar(v)) for v in columns["group_id"]])


def outcome_advantages(estimator: str, kwargs: dict) -> Callable[[list[float], list], list[float]]:
    """`(rewards, group_ids) -> advantages` of an outcome estimator, over the rows given (a whole step)."""
    import torch

    from relax_core.algorithms.estimators import AdvantageBatch
    from relax_core.algorithms.registry import get_estimator
    from relax_core.train.step_advantages import dense_ids

    fn = get_estimator(estimator)

    def advantages(rewards: list[float], group_ids: list) -> list[float]:
        batch = AdvantageBatch(rewards=torch.tensor(rewards, dtype=torch.float32), group_ids=dense_ids(group_ids),
                               mask=torch.ones((len(rewards), 1)))
        return fn(batch, **kwargs).advantages[:, 0].tolist()

    return advantages
