"""Shared test set-up: no test may reach the network or a model hub."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import pytest  # noqa: E402


@pytest.fixture
def one_torch_thread():
    """Intra-op threads only slow a tiny model down on a shared 2-core machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


from slurm_cluster import mark_slurm_tests, slurm_cluster  # noqa: E402,F401  (session fixture)


def pytest_collection_modifyitems(config, items):
    mark_slurm_tests(items)
