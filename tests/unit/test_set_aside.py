"""What rank 0 keeps of the weights for engines on GPUs of their own (controller/workers.set_aside): copies
that later steps leave alone, in host memory, and no second copy of what is apart from the parameters."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from relax_core.controller.workers import set_aside

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def test_a_parameter_is_copied_and_a_tensor_already_apart_is_kept_as_it_is():
    model = torch.nn.Linear(3, 2)
    gathered = torch.randn(2, 3)  # what a gather from shards or a cast to the compute dtype returns
    kept = dict(set_aside([("weight", model.weight), ("gathered", gathered), ("bias", model.bias[:1])],
                          model.parameters()))
    with torch.no_grad():
        model.weight.add_(1.0)  # the next step
        model.bias.add_(1.0)
    assert not torch.equal(kept["weight"], model.weight) and not kept["weight"].requires_grad
    assert kept["bias"].data_ptr() != model.bias.data_ptr()  # a view of a parameter is a parameter's storage
    assert kept["gathered"].data_ptr() == gathered.data_ptr()  # no second copy


def test_weights_on_an_accelerator_are_kept_in_host_memory():
    from sim_device import DEVICE, SimDevice

    with SimDevice():
        model = torch.nn.Linear(3, 2, device=DEVICE)
        kept = set_aside(model.named_parameters(), model.parameters())
    assert all(tensor.device.type == "cpu" for _, tensor in kept)
    assert [name for name, _ in kept] == ["weight", "bias"]
