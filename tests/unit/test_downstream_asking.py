"""Which service worker the rollout service asks to process which rows of a step (services/rollout.py):
the reference workers as the groups stream in, a micro-batch at a time, the advantage service once per
step (its estimator and whitening need the whole step)."""

from relax_core.services.rollout import Downstream, _Asking


class Worker:
    """A service handle that records the `process.remote(step, rows)` calls it gets."""

    def __init__(self, log: list, name: str):
        self.process = self
        self.log, self.name = log, name

    def remote(self, step: int, rows: int) -> tuple:
        self.log.append((self.name, step, rows))
        return (self.name, rows)


def test_reference_rows_go_out_a_micro_batch_at_a_time_in_turn_and_advantages_once_per_step():
    log: list = []
    downstream = [Downstream("reference", Worker(log, "ref0"), batch_rows=16),
                  Downstream("reference", Worker(log, "ref1"), batch_rows=16),
                  Downstream("advantages", Worker(log, "adv"), whole_step=True)]
    asking = _Asking(7, downstream)
    for _ in range(5):  # five groups of 8 samples: 40 rows
        asking.put(8)
    assert log == [("ref0", 7, 16), ("ref1", 7, 16)]  # asked while the step still generates
    calls = asking.finish()
    assert log == [("ref0", 7, 16), ("ref1", 7, 16), ("ref0", 7, 8), ("adv", 7, 40)]
    assert sorted(calls) == sorted([("ref0", 16), ("ref1", 16), ("ref0", 8), ("adv", 40)])
    for service in ("ref", "adv"):  # every row processed once by each service
        assert sum(rows for name, _, rows in log if name.startswith(service)) == 40


def test_a_step_whose_rows_fit_one_micro_batch_is_one_call_per_service():
    log: list = []
    asking = _Asking(3, [Downstream("reference", Worker(log, "ref"), batch_rows=64),
                         Downstream("advantages", Worker(log, "adv"), whole_step=True)])
    asking.put(8)
    asking.put(8)
    assert log == []
    asking.finish()
    assert log == [("ref", 3, 16), ("adv", 3, 16)]
