"""The address a Ray node advertises: never the loopback address Debian's /etc/hosts gives the hostname in a
multi-node job, and the interface NCCL and Gloo use is the one the address belongs to.

Real interfaces throughout: this machine's (the test namespace has `lo` only), and a network namespace of its
own (`unshare --net --mount --uts`, root) with a veth pair named like a cluster node's `ib0` and `eth0`, a
hostname that /etc/hosts (bind-mounted over) maps to 127.0.1.1, and routes set as each case needs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from relax_core.cluster.address import pick_address
from relax_core.cluster.node import node_env, pick_node_address
from relax_core.config import load_recipe
from relax_core.rundir import RunDir

QUICKSTART = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"


def test_the_first_pattern_that_exists_on_the_node_wins(tmp_path):
    recipe = load_recipe(QUICKSTART, ['cluster.network.interface=["ib0", "eth*", "l*"]'])
    picked = pick_node_address(recipe)
    assert (picked.interface, picked.address) == ("lo", "127.0.0.1")  # no ib0, no eth*: lo matches l*
    env = node_env(recipe, RunDir(tmp_path).create(), "train", picked)
    assert env["NCCL_SOCKET_IFNAME"] == "=lo" and env["GLOO_SOCKET_IFNAME"] == "lo"  # NCCL: exactly lo
    assert env["RELAX_NODE_IP"] == "127.0.0.1"


def test_one_interface_name_alone_still_works():
    recipe = load_recipe(QUICKSTART, ["cluster.network.interface=lo"])
    assert recipe.cluster.network.interface == ["lo"]
    assert pick_node_address(recipe).address == "127.0.0.1"


def test_no_matching_interface_is_refused_naming_the_field_and_what_the_node_has():
    with pytest.raises(RuntimeError) as err:
        pick_address(["ib*", "eth9"], head=None, multi_node=True)
    assert "cluster.network.interface" in str(err.value) and "it has: lo" in str(err.value)


def test_a_malformed_interface_list_is_a_recipe_error():
    from relax_core.errors import RecipeError

    with pytest.raises(RecipeError, match="interface"):
        load_recipe(QUICKSTART, ["cluster.network.interface=ib0 eth0"])


NODE = """
import json, subprocess, sys
from relax_core.cluster.address import pick_address

def ip(*args):
    subprocess.run(["ip", *args], check=True)

def pick(patterns=None, head=None, multi_node=True):
    try:
        p = pick_address(patterns, head=head, multi_node=multi_node)
        return [p.address, p.interface, p.socket_env()]
    except RuntimeError as exc:
        return str(exc)

hosts = sys.argv[1]
open(hosts, "w").write("127.0.0.1 localhost\\n127.0.1.1 gpu-node-07\\n")  # Debian's default, as on the node
subprocess.run(["mount", "--bind", hosts, "/etc/hosts"], check=True)
subprocess.run(["hostname", "gpu-node-07"], check=True)
ip("link", "set", "lo", "up")
ip("link", "add", "ib0", "type", "veth", "peer", "name", "eth0")
for name in ("ib0", "eth0"):
    ip("link", "set", name, "up")
ip("addr", "add", "10.77.0.1/24", "dev", "ib0")
import socket
seen = {"hostname": socket.gethostbyname(socket.gethostname())}
seen["only ib0 has an address"] = pick()
ip("addr", "add", "10.88.0.1/24", "dev", "eth0")
ip("route", "add", "default", "dev", "eth0")
seen["default route"] = pick()
from relax_core.cluster.node import pick_node_address
from relax_core.config import load_recipe
worker = pick_node_address(load_recipe(sys.argv[2]), "10.77.0.200:10000")  # as `--head-address` gives it
seen["route to the head"] = [worker.address, worker.interface, worker.socket_env()]
seen["ib*, eth*"] = pick(["ib*", "eth*"])
seen["eth*"] = pick(["eth*"])
ip("link", "del", "ib0")
seen["nothing but lo, multi-node"] = pick()
seen["nothing but lo, one node"] = pick(multi_node=False)
print(json.dumps(seen))
"""


def test_a_node_whose_hostname_resolves_to_127_0_1_1_advertises_its_interface(tmp_path):
    proc = subprocess.run(["unshare", "--net", "--mount", "--uts", sys.executable, "-c", NODE,
                           str(tmp_path / "hosts"), str(QUICKSTART)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    assert seen["hostname"] == "127.0.1.1"  # what gethostbyname(gethostname()) gave Ray before
    ib0 = ["10.77.0.1", "ib0", {"NCCL_SOCKET_IFNAME": "=ib0", "GLOO_SOCKET_IFNAME": "ib0"}]
    eth0 = ["10.88.0.1", "eth0", {"NCCL_SOCKET_IFNAME": "=eth0", "GLOO_SOCKET_IFNAME": "eth0"}]
    assert seen["only ib0 has an address"] == ib0  # eth0 is up but has no address
    assert seen["default route"] == eth0
    assert seen["route to the head"] == ib0  # the head's network beats the default route
    assert seen["ib*, eth*"] == ib0 and seen["eth*"] == eth0
    refused = seen["nothing but lo, multi-node"]
    assert "gpu-node-07 resolves to 127.0.1.1" in refused and "set cluster.network.interface" in refused
    assert seen["nothing but lo, one node"] == ["127.0.1.1", None, {}]  # one node: loopback is enough
