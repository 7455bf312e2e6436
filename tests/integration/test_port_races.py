"""sglang-router cannot be handed a bound socket, so its ports are picked just before it starts; when
another process takes one first, the router is started again on fresh ports instead of failing.

Real router process and real CPU engine; the race is made certain by picking, for the first start,
a port some other program already listens on.
"""

from __future__ import annotations

import socket

import pytest
from engine_fixtures import ENGINE_API_KEY as API_KEY
from engine_fixtures import HOST

from relax_core.cluster import ports
from relax_core.rollout import router as router_module
from relax_core.rollout.router import Router

# `engine` (conftest.py): the session's engine server on `tiny_model_dir`, behind each router here.


@pytest.mark.parametrize("taken", ["port", pytest.param("metrics_port", marks=pytest.mark.full(
    covered_by="tests/integration/test_port_races.py::test_the_router_starts_on_fresh_ports_when_a_picked_one_was_taken[port]"))])
def test_the_router_starts_on_fresh_ports_when_a_picked_one_was_taken(engine, tiny_model_dir, tmp_path,
                                                                      monkeypatch, taken):
    with socket.socket() as other:  # another program, listening on the port the router is about to get
        other.bind((HOST, 0))
        other.listen()
        occupied = other.getsockname()[1]
        picks = iter([occupied] if taken == "port" else [ports.candidate_port(HOST), occupied])
        first_picks = lambda host: next(picks, None) or ports.candidate_port(host)  # noqa: E731
        monkeypatch.setattr(router_module, "candidate_port", first_picks)
        router = Router(HOST, None, str(tiny_model_dir), API_KEY, str(tmp_path / "router.log"))
        try:
            router.start([engine.base_url])
            assert occupied not in (router.port, router.metrics_port)
            assert "Address already in use" in (tmp_path / "router.log").read_text()  # the first start failed
        finally:
            router.stop()


def test_a_port_the_caller_chose_is_not_replaced(engine, tiny_model_dir, tmp_path):
    with socket.socket() as other:
        other.bind((HOST, 0))
        other.listen()
        router = Router(HOST, other.getsockname()[1], str(tiny_model_dir), API_KEY, str(tmp_path / "router.log"))
        with pytest.raises(router_module.RouterError, match="Address already in use"):
            router.start([engine.base_url])
