"""Services that add a column to each step's rows: reference log-probs and advantages (`fully_async`).

    rollout service: partition s is in TransferQueue  ->  worker.process(s, rows)
        worker: claim `rows` rows it has not processed, read only its input columns,
                compute, write its column on the same rows      (returns the number of rows)
    driver: waits for those calls, then claims the complete rows for the trainer ranks

`ReferenceWorker` holds the frozen reference model (the initial policy) on its
node group's GPU (`cluster.reference`; on CPU in a CPU run) and writes
`ref_logprobs`, one log-prob per response token, exactly what the trainer's own
reference forward would give (the same packing and forward, train/batching.py).
A frozen model can run ahead of the trainer: its numbers do not depend on the
step. `AdvantageWorker` runs an outcome estimator (one whose spec says
`outcome_only`: rewards and group ids suffice) over the whole step and writes
`advantages`, one per row. Several reference workers share a partition (each
takes its share of rows); the advantage worker takes the whole step at once,
as group baselines and whitening need.

What depends on the weights a step starts from is computed by the trainer ranks
themselves, in every mode: logp_old (the anchor of the PPO ratio and of the
importance weight against the rollout's log-probs) and PPO's critic values. A
service could hold those weights only once the step before has trained, so it
would sit on the step's critical path anyway, on fewer devices than the trainer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from relax_core.data.sample import Sample
from relax_core.models.multimodal import pad_token_id

REFERENCE_COLUMN, ADVANTAGE_COLUMN = "ref_logprobs", "advantages"


class _FieldWorker:
    """Common part: cores, threads, the bus, and `process`."""

    consumer: str
    inputs: tuple[str, ...]
    output: str

    def __init__(self, threads: int, cpus: list[int] | None):
        import torch

        from relax_core.cluster.actors import pin_process
        from relax_core.data.bus import import_tq

        if cpus:
            pin_process(cpus)
        torch.set_num_threads(threads)
        import_tq()  # now, while the job starts, not in the first step
        self.bus = None  # TransferQueue, attached on the first step (it starts while the models load)
        self._attaching = threading.Lock()  # a threaded worker's first calls may come together
        self.rows = 0  # processed so far (tests and logs)

    def node_id(self) -> str:
        from relax_core.cluster.actors import node_id

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
                 cpus: list[int] | None = None, trust_remote_code: bool = False, device: str = "cpu"):
        """`device`: "cuda" on a reference group with GPUs (Ray gives this actor one, device 0), else "cpu"."""
        super().__init__(threads, cpus)
        from relax_core.cluster.actors import accelerator
        from relax_core.train.torch_backend import load_causal_lm

        self.device = accelerator(device, "cluster.reference.gpus_per_node")
        self.model = load_causal_lm(model_dir, dtype, self.device, trust_remote_code).requires_grad_(False)
        self.pad_id = pad_token_id(self.model)
        self.micro_batch_size = micro_batch_size

    def compute(self, columns: dict[str, list]) -> list[list[float]]:
        return token_logprobs(self.model, self.pad_id, self.micro_batch_size, columns, self.device)


def token_logprobs(model, pad_id: int, micro_batch_size: int, columns: dict[str, list],
                   device: str = "cpu") -> list[list[float]]:
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
            mb = pack(part, pad_id, device)
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
