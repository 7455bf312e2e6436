"""Checkpoint save/resume in Megatron's layout with torch.distributed.checkpoint.

What a user relies on: a resumed run continues exactly like one that never
stopped (weights, AdamW moments, LR schedule, data cursor, random draws);
a crash while saving never leaves a broken checkpoint marked latest; and
the same calls work on several gloo ranks. Expected values come from an
uninterrupted run of the same training code, never from the checkpoint code.
"""

from __future__ import annotations

import json
import os
import random
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as torch_dcp
import torch.multiprocessing as mp
from gloo_exit import leave_group
from torch.distributed.checkpoint.api import CheckpointException

from relax_core.checkpoint import layout
from relax_core.checkpoint.dcp import load_checkpoint, save_checkpoint
from relax_core.checkpoint.layout import CheckpointError, find_latest, list_iterations


def _build(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.3), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _train(model, opt, sched, steps: int) -> None:
    """Each step draws from all three generators, so a wrong RNG restore changes the weights."""
    for _ in range(steps):
        x = torch.randn(4, 6) * (1 + random.random()) + float(np.random.rand())
        model(x).pow(2).mean().backward()  # dropout draws from torch's generator
        opt.step()
        opt.zero_grad()
        sched.step()


def _draws():
    return torch.rand(5), [random.random() for _ in range(3)], np.random.rand(3)


def _seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _snapshot(model, opt, sched) -> dict:
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "exp_avg": [opt.state[p]["exp_avg"].clone() for p in model.parameters()],
        "exp_avg_sq": [opt.state[p]["exp_avg_sq"].clone() for p in model.parameters()],
        "opt_step": [float(opt.state[p]["step"]) for p in model.parameters()],
        "lr": opt.param_groups[0]["lr"],
        "sched": {k: v for k, v in sched.state_dict().items() if k != "lr_lambdas"},
    }


def _assert_same(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for name in ("exp_avg", "exp_avg_sq"):
        assert all(torch.equal(x, y) for x, y in zip(a[name], b[name], strict=True)), name
    assert (a["opt_step"], a["lr"], a["sched"]) == (b["opt_step"], b["lr"], b["sched"])


def _state(model, opt, sched, cursor, step) -> dict:
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "data": cursor,
        "step": step,
        "policy_version": step,
    }


def test_resume_is_bit_identical_to_uninterrupted_run(tmp_path):
    ckpt = tmp_path / "ckpt"
    _seed_all(0)
    model, opt, sched = _build(0)
    _train(model, opt, sched, 3)
    save_checkpoint(ckpt, 3, _state(model, opt, sched, {"epoch": 1, "offset": 12, "order": [3, 1, 2]}, 3))
    at_save = _snapshot(model, opt, sched)
    expected_draws = _draws()
    _train(model, opt, sched, 2)
    expected_final = _snapshot(model, opt, sched)

    # A "new process": other seeds, freshly built objects with empty optimizer state.
    _seed_all(123)
    model2, opt2, sched2 = _build(7)
    template = _state(model2, opt2, sched2, {"epoch": 0, "offset": 0, "order": []}, 0)
    assert load_checkpoint(ckpt, template) == 3
    opt2.load_state_dict(template["optimizer"])
    sched2.load_state_dict(template["scheduler"])
    assert template["data"] == {"epoch": 1, "offset": 12, "order": [3, 1, 2]}
    assert (template["step"], template["policy_version"]) == (3, 3)
    _assert_same(_snapshot(model2, opt2, sched2), at_save)

    draws = _draws()
    assert torch.equal(draws[0], expected_draws[0])
    assert draws[1] == expected_draws[1]
    assert np.array_equal(draws[2], expected_draws[2])
    _train(model2, opt2, sched2, 2)
    _assert_same(_snapshot(model2, opt2, sched2), expected_final)


def test_layout_matches_megatron_and_objects_can_be_passed_directly(tmp_path):
    ckpt = tmp_path / "ckpt"
    model, opt, sched = _build(1)
    _train(model, opt, sched, 2)
    saved = save_checkpoint(
        ckpt, 10, {"model": model, "optimizer": opt, "scheduler": sched}, extra_files={"recipe.yaml": "lr: 0.01\n"}
    )
    assert saved == ckpt / "iter_0000010"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "10"
    files = {p.name for p in saved.iterdir()}
    assert {".metadata", "__0_0.distcp", "relax_meta.json", "recipe.yaml"} <= files
    meta = json.loads((saved / "relax_meta.json").read_text())
    assert (meta["iteration"], meta["format_version"], meta["world_size"]) == (10, 1, 1)
    # The files are a plain DCP checkpoint: torch's own reader sees the weights under model.*.
    names = torch_dcp.FileSystemReader(saved).read_metadata().state_dict_metadata
    assert {f"model.{k}" for k in model.state_dict()} <= set(names)

    at_save = _snapshot(model, opt, sched)
    model2, opt2, sched2 = _build(2)
    assert load_checkpoint(ckpt, {"model": model2, "optimizer": opt2, "scheduler": sched2}) == 10
    _assert_same(_snapshot(model2, opt2, sched2), at_save)


def _crash(*_args, **_kwargs):
    raise RuntimeError("simulated crash")


def _small_state(value: float, step: int) -> dict:
    return {"model": {"w": torch.full((64, 64), value)}, "step": step}


def _loaded(ckpt: Path, iteration=None) -> tuple[int, float, int]:
    template = {"model": {"w": torch.zeros(64, 64)}, "step": -1}
    it = load_checkpoint(ckpt, template, iteration)
    return it, float(template["model"]["w"][0, 0]), template["step"]


def test_crash_mid_save_keeps_previous_checkpoint_latest(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    save_checkpoint(ckpt, 10, _small_state(1.0, 10))

    # Crash 1: inside DCP, after the data file is written but before .metadata.
    with monkeypatch.context() as patch:
        patch.setattr(torch_dcp.FileSystemWriter, "finish", _crash)
        with pytest.raises(CheckpointException):  # DCP reports the crash of its writer this way
            save_checkpoint(ckpt, 20, _small_state(2.0, 20))
    staging = ckpt / ".tmp_iter_0000020"
    assert any(p.suffix == ".distcp" for p in staging.iterdir()), "the crash should hit a partly written save"
    assert not (staging / ".metadata").exists()
    assert not (ckpt / "iter_0000020").exists()
    assert find_latest(ckpt) == 10
    assert _loaded(ckpt) == (10, 1.0, 10)

    # Crash 2: the new directory is complete and in place, the tracker not yet replaced.
    with monkeypatch.context() as patch:
        patch.setattr(layout, "write_tracker", _crash)
        with pytest.raises(RuntimeError, match="simulated crash"):
            save_checkpoint(ckpt, 20, _small_state(2.0, 20))
    assert (ckpt / "iter_0000020").is_dir()
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "10"
    assert _loaded(ckpt) == (10, 1.0, 10)

    # The next save of the same iteration replaces the orphan and clears the crashed staging dir.
    save_checkpoint(ckpt, 20, _small_state(2.5, 20))
    assert _loaded(ckpt) == (20, 2.5, 20)
    assert not any(p.name.startswith(".tmp_") for p in ckpt.iterdir())


def test_keep_last_prunes_only_after_the_new_checkpoint_is_latest(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    for it in (10, 20, 30):
        save_checkpoint(ckpt, it, _small_state(float(it), it), keep_last=2)
    assert list_iterations(ckpt) == [20, 30]
    assert find_latest(ckpt) == 30

    with monkeypatch.context() as patch:
        patch.setattr(torch_dcp.FileSystemWriter, "finish", _crash)
        with pytest.raises(CheckpointException):  # DCP reports the crash of its writer this way
            save_checkpoint(ckpt, 40, _small_state(40.0, 40), keep_last=1)
    assert list_iterations(ckpt) == [20, 30]
    assert _loaded(ckpt) == (30, 30.0, 30)
    assert _loaded(ckpt, 20) == (20, 20.0, 20)

    save_checkpoint(ckpt, 40, _small_state(40.0, 40), keep_last=1)
    assert list_iterations(ckpt) == [40]
    assert _loaded(ckpt) == (40, 40.0, 40)


def test_user_errors_raise_checkpoint_error_naming_the_file(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(CheckpointError, match=str(missing)):
        load_checkpoint(missing, {})
    assert find_latest(missing) is None

    ckpt = tmp_path / "ckpt"
    save_checkpoint(ckpt, 5, _small_state(5.0, 5))
    tracker = ckpt / "latest_checkpointed_iteration.txt"

    tracker.write_text("7\n")
    with pytest.raises(CheckpointError, match="iter_0000007"):
        load_checkpoint(ckpt, {"model": {"w": torch.zeros(64, 64)}})
    with pytest.raises(CheckpointError, match="iter_0000007"):
        find_latest(ckpt)
    tracker.write_text("garbage")
    with pytest.raises(CheckpointError, match=str(tracker)):
        find_latest(ckpt)
    tracker.unlink()
    with pytest.raises(CheckpointError, match=str(tracker)):
        load_checkpoint(ckpt, {"model": {"w": torch.zeros(64, 64)}})
    assert find_latest(ckpt) is None

    metadata = ckpt / "iter_0000005" / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:40])
    with pytest.raises(CheckpointError, match=str(metadata)):
        load_checkpoint(ckpt, {"model": {"w": torch.zeros(64, 64)}}, iteration=5)
    # A template that does not match the checkpoint (another model) is a user error too.
    save_checkpoint(ckpt, 6, _small_state(6.0, 6))
    with pytest.raises(CheckpointError, match="shape"):
        load_checkpoint(ckpt, {"model": {"w": torch.zeros(8, 8)}})


# ---- two gloo ranks ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, root: str) -> None:
    """One trainer rank: replicated model, rank-specific RNG streams (as in data parallelism)."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ckpt = Path(root) / "ckpt"
        model, opt, sched = _build(0)
        _seed_all(100)  # same draws on every rank: replicas stay equal, as all-reduced replicas do
        _train(model, opt, sched, 2)
        _seed_all(200 + rank)  # from here on each rank has its own stream, which must survive
        save_checkpoint(ckpt, 2, _state(model, opt, sched, {"offset": 2 * world}, 2), keep_last=1)
        tracker_seen = find_latest(ckpt)
        expected = _draws()

        _seed_all(999)
        model2, opt2, sched2 = _build(5)
        template = _state(model2, opt2, sched2, {}, 0)
        loaded = load_checkpoint(ckpt, template)
        opt2.load_state_dict(template["optimizer"])
        sched2.load_state_dict(template["scheduler"])
        draws = _draws()
        same_state = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
        same_opt = all(
            torch.equal(opt.state[p]["exp_avg_sq"], opt2.state[q]["exp_avg_sq"])
            for p, q in zip(model.parameters(), model2.parameters())
        )
        result = {
            "tracker_seen": tracker_seen,
            "loaded": loaded,
            "cursor": template["data"],
            "same_state": same_state,
            "same_opt": same_opt,
            "same_torch_draw": torch.equal(draws[0], expected[0]),
            "same_python_draw": draws[1] == expected[1],
            "same_numpy_draw": bool(np.array_equal(draws[2], expected[2])),
            "python_draw": draws[1],
        }
        (Path(root) / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        leave_group()


def test_two_gloo_ranks_save_and_resume(tmp_path):
    mp.spawn(_rank_main, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for res in results:
        assert res["tracker_seen"] == res["loaded"] == 2
        assert res["cursor"] == {"offset": 4}
        assert res["same_state"] and res["same_opt"]
        assert res["same_torch_draw"] and res["same_python_draw"] and res["same_numpy_draw"]
    # Each rank got its own RNG stream back, not rank 0's.
    assert results[0]["python_draw"] != results[1]["python_draw"]
    files = {p.name for p in (tmp_path / "ckpt" / "iter_0000002").iterdir()}
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "relax_meta.json"} <= files
    assert json.loads((tmp_path / "ckpt" / "iter_0000002" / "relax_meta.json").read_text())["world_size"] == 2


def _rank0_section_main(rank: int, world: int, port: int, root: str) -> None:
    """Every rank saves its model; rank 0 alone adds a section (as it does the run's progress)."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model, _, _ = _build(0)
        state: dict = {"model": model.state_dict()}
        if rank == 0:
            side, opt, sched = _build(1)
            _train(side, opt, sched, 2)
            state["side"] = {"model": side.state_dict(), "optimizer": opt.state_dict()}
            torch.save(_snapshot(side, opt, sched), Path(root) / "side.pt")
        save_checkpoint(Path(root) / "ckpt", 2, state)
    finally:
        leave_group()


def test_a_section_of_rank_0_alone_loads_whole_in_another_process(tmp_path):
    """DCP keeps one rank's copy of the saved paths; a section only rank 0 holds must be in it, or a fresh
    optimizer would get no Adam moments back."""
    mp.spawn(_rank0_section_main, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    side, opt, _ = _build(7)
    template = {"side": {"model": side.state_dict(), "optimizer": opt.state_dict()}}
    load_checkpoint(tmp_path / "ckpt", template, restore_rng=False)
    opt.load_state_dict(template["side"]["optimizer"])
    expected = torch.load(tmp_path / "side.pt")
    for key, value in side.state_dict().items():
        assert torch.equal(value, expected["model"][key]), key
    for name in ("exp_avg", "exp_avg_sq"):
        assert all(torch.equal(opt.state[p][name], e) for p, e in zip(side.parameters(), expected[name], strict=True))
    assert [float(opt.state[p]["step"]) for p in side.parameters()] == expected["opt_step"]
