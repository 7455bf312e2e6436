"""Trainer rank 0 hands the GIL over quickly while the engines wait for its weights (controller/workers.py)."""

import sys

import pytest

from relax_core.controller.workers import SYNC_SWITCH_INTERVAL_S, quick_gil_handoff


def test_the_switch_interval_is_short_only_during_a_sync_while_generating_and_restored_after_a_failure():
    before = sys.getswitchinterval()
    with quick_gil_handoff(False):  # colocate: nothing else runs in the process
        assert sys.getswitchinterval() == before
    with pytest.raises(RuntimeError):
        with quick_gil_handoff(True):
            assert sys.getswitchinterval() == pytest.approx(SYNC_SWITCH_INTERVAL_S)
            raise RuntimeError("the broadcast failed")
    assert sys.getswitchinterval() == before
