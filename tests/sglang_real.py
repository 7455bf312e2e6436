"""SGLang's own code on a CPU machine: its functions imported, and an engine stand-in built on them.

A stand-in written from our own understanding of SGLang agrees with our own mistakes (a trainer that
formed its weight-update group with the wrong store keys passed every test against a CPU engine built
the same way). So where SGLang's code runs without a GPU, the tests run it: its
`init_custom_process_group` forms the engine's side of the weight-update group, its
`MultiprocessingSerializer` decodes the payloads of `/update_weights_from_tensor`.

`load()` imports them. The test install has SGLang's source only (`pip install --no-deps
sglang==0.5.23`, .ci/run), and `import sglang.srt.utils` (sglang 0.5.23) stops at three top-level
imports of modules it does not install:

  pybase64  sglang/srt/utils/common.py:87: a real dependency of the code under test
            (`MultiprocessingSerializer` decodes base64 with it, common.py:3089); the `dev` extra
            installs it.
  triton    sglang/srt/utils/common.py:91 `import triton`, and :3701 `setattr(triton,
            "next_power_of_2", ...)`: GPU kernels (about 1 GB installed). None of the functions used
            here touches it. When it is not installed, an empty module stands in for it during the
            import only, and is taken out of `sys.modules` afterwards, so that nothing else in the
            process (torch's `has_triton_package`, which is computed before, see `_import`) ever
            sees it.
  IPython   sglang/utils.py:25 `from IPython.display import HTML, display` (reached through
            sglang/__init__.py:57 `from sglang.utils import LazyImport`): notebook helpers, unused
            here. When it is not installed, `IPython.display` stands in with those two names, which
            raise if called, during the import only (and `IPython.get_ipython`, which says "no
            notebook" to the libraries that ask meanwhile).

A failed first import leaves `sglang.srt` in `sys.modules` without its parent `sglang` (Python drops
the package whose `__init__` raised, not the submodules it had finished), so the next
`from sglang.srt.utils import ...` fails with `KeyError: 'sglang'` in importlib's namespace-path
lookup, hiding the first error; `load()` removes the half-imported modules, so each attempt reports
the real cause.

Importing `sglang` applies its transformers patches to the whole process (sglang/__init__.py:21-23,
`hf_transformers_patches.apply_all`), so `load()` refuses to run inside pytest: the tests call it in
the child processes they start (this file as a script, or their own).

`python tests/sglang_real.py engine --host H --port P` serves an engine stand-in whose
weight-update group is SGLang's own: `/init_weights_update_group` calls `init_custom_process_group`
exactly as SGLang's model runner does, `/update_weights_from_distributed` receives as SGLang's does
(its two torch calls per tensor; with `load_format="flattened_bucket"`, which Relax sends, SGLang's own
`FlattenedTensorBucket` lays out and takes apart the one broadcast tensor), and `/received`
saves what arrived for the test to compare. SGLang's receive method itself cannot be imported here
(its module imports torchvision and the model loaders), so its few lines are mirrored below, pinned
by line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import threading
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

SGLANG_VERSION = "0.5.23"  # the line numbers above and below are of this release
_LOADED: types.SimpleNamespace | None = None


def load() -> types.SimpleNamespace:
    """SGLang's functions for the stand-ins (imported once per process; never inside pytest)."""
    global _LOADED
    if _LOADED is None:
        if _runs_pytest():
            raise RuntimeError("importing sglang patches transformers for the whole process (sglang/__init__.py:"
                               "21-23): call tests/sglang_real.py load() in a child process, not in pytest's")
        _LOADED = _import()
    return _LOADED


def _runs_pytest() -> bool:
    """Whether this process is pytest's own (`pytest ...` or `python -m pytest ...`); its children are not."""
    entry = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path()
    return entry.name in ("pytest", "py.test") or entry.parent.name == "pytest"


def _import() -> types.SimpleNamespace:
    if importlib.util.find_spec("pybase64") is None:
        raise ImportError("SGLang's serializer needs pybase64 (sglang/srt/utils/common.py:87): pip install -e '.[dev]'")
    # torch decides once (functools.cache) whether triton is installed; it must decide before a stand-in exists.
    import torch._dynamo  # noqa: F401
    from torch.utils._triton import has_triton_package

    has_triton_package()
    stand_ins = _stand_ins()
    sys.modules.update(stand_ins)
    try:
        from sglang.srt.utils import common, patch_torch, weight_versions
        from sglang.srt.utils.network import NetworkAddress
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
    except BaseException:
        for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
            del sys.modules[name]  # else the next attempt fails with KeyError: 'sglang' (see the module docstring)
        raise
    finally:
        for name, module in stand_ins.items():
            if sys.modules.get(name) is module:
                del sys.modules[name]
    return types.SimpleNamespace(
        init_custom_process_group=common.init_custom_process_group,
        MultiprocessingSerializer=common.MultiprocessingSerializer,
        SafeUnpickler=common.SafeUnpickler,
        normalize_serialized_named_tensor_payloads=common.normalize_serialized_named_tensor_payloads,
        monkey_patch_torch_reductions=patch_torch.monkey_patch_torch_reductions,
        patch_torch=patch_torch,
        NetworkAddress=NetworkAddress,
        FlattenedTensorBucket=FlattenedTensorBucket,
        weight_versions=weight_versions,
    )


def _stand_ins() -> dict[str, types.ModuleType]:
    """Empty modules for what is not installed among the imports that nothing used here runs."""
    modules: dict[str, types.ModuleType] = {}
    if importlib.util.find_spec("triton") is None:
        modules["triton"] = types.ModuleType("triton", "stand-in for sglang/srt/utils/common.py:91 (sglang_real.py)")
    if importlib.util.find_spec("IPython") is None:
        ipython = types.ModuleType("IPython", "stand-in for sglang/utils.py:25 (tests/sglang_real.py)")
        display = types.ModuleType("IPython.display")
        display.HTML = display.display = _not_here
        ipython.display = display
        ipython.get_ipython = lambda: None  # what libraries probing for a notebook (huggingface_hub) ask: none
        modules |= {"IPython": ipython, "IPython.display": display}
    return modules


def _not_here(*args, **kwargs):
    raise RuntimeError("IPython is a stand-in in this process (tests/sglang_real.py)")


# ------------------------------------------------------------------ where SGLang is not installed
def init_custom_process_group_pinned(*, backend: str, init_method: str, world_size: int, rank: int,
                                     group_name: str, timeout=None):
    """SGLang 0.5.23's `init_custom_process_group` (sglang/srt/utils/common.py:2859-2927), step by step, for a
    machine where SGLang cannot be imported (the GPU test machine, tests/gpu/check.py): the rendezvous of
    `init_method` (:2899-2901), its store wrapped in `PrefixStore(group_name, store)` (:2905), a group of
    its own over it (`_new_process_group_helper` with no ranks, :2913-2923) whose ranks are the group's own
    (:2925). tests/integration/test_sglang_weight_group.py holds it to SGLang's function: both join one
    group, which forms only if they key the rendezvous alike."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        default_pg_timeout,
        rendezvous,
    )

    timeout = timeout or default_pg_timeout
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                         backend_options=None, timeout=timeout, device_id=None)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def _join_and_receive(which: str, init_method: str, world_size: int, rank: int, shapes: list, out: str) -> None:
    """A child process: rank `rank` of a gloo group made by SGLang's function or the pinned copy (`which`),
    receiving one float32 broadcast per shape from rank 0; their sums go to `out` (JSON)."""
    import torch
    import torch.distributed as dist

    make = load().init_custom_process_group if which == "sglang" else init_custom_process_group_pinned
    group = make(backend="gloo", init_method=init_method, world_size=world_size, rank=rank,
                 group_name="weight_update_group")
    sums = []
    for shape in shapes:
        t = torch.empty(shape)
        dist.broadcast(t, src=0, group=group)
        sums.append(float(t.sum()))
    Path(out).write_text(json.dumps(sums))
    # Leave as the test ranks do (tests/integration/gloo_exit.py): once every rank is done, and without gloo's
    # teardown at exit, which aborted this child now and then ('terminate called without an active exception').
    dist.barrier(group=group)
    os._exit(0)


# ------------------------------------------------------------------ which version made which tokens
def weight_versions_meta(events: list[list], current_version: str, num_output_tokens: int) -> dict:
    """The meta_info SGLang 0.5.23 gives a request that finished with `num_output_tokens` output tokens at
    `current_version`, after weight changes that recorded `events` ([old version, output tokens then], ...):
    its scheduler's spans (`compute_weight_version_spans`, scheduler_components/output_streamer.py:542-548) as
    its tokenizer manager adds them (`add_weight_versions_to_meta_info`, tokenizer_manager.py:2560-2568)."""
    versions = load().weight_versions
    spans = versions.compute_weight_version_spans(
        [versions.WeightVersionEvent(old_version=old, num_output_tokens=n) for old, n in events],
        current_version=current_version, num_output_tokens=num_output_tokens)
    meta: dict = {"weight_version": current_version}
    versions.add_weight_versions_to_meta_info(meta, spans, num_output_tokens=num_output_tokens)
    return meta


# ------------------------------------------------------------------ the engine stand-in
class _Engine:
    """What one SGLang engine (TP 1, on CPU) holds for the weight sync."""

    def __init__(self) -> None:
        self.sglang = load()
        self.groups: dict = {}  # group name -> process group (SGLang's `_model_update_group`)
        self.session = False
        self.received: dict = {}  # name -> the last tensor received under it
        self.load_formats: list = []  # each update_weights_from_distributed's load_format, in order
        self.weight_version = "default"

    def init_weights_update_group(self, body: dict) -> tuple[bool, str]:
        # sglang/srt/model_executor/model_runner_components/weight_updater.py:100-144 (tp_rank 0)
        try:
            address = self.sglang.NetworkAddress(body["master_address"], body["master_port"])
            self.groups[body["group_name"]] = self.sglang.init_custom_process_group(
                backend=body.get("backend", "nccl"),
                init_method=address.to_tcp(),
                world_size=body["world_size"],
                rank=body["rank_offset"] + 0,
                group_name=body["group_name"],
            )
        except Exception as exc:  # noqa: BLE001 - SGLang answers with the error
            return False, f"Failed to initialize custom process group: {exc}."
        return True, "Succeeded to initialize custom process group."

    def destroy_weights_update_group(self, body: dict) -> tuple[bool, str]:
        import torch.distributed as dist

        # weight_updater.py:146-157
        if body["group_name"] not in self.groups:
            return False, "The group to be destroyed does not exist."
        dist.destroy_process_group(self.groups.pop(body["group_name"]))
        return True, "Succeeded to destroy custom process group."

    def update_weights_from_distributed(self, body: dict) -> tuple[bool, str]:
        # sglang/srt/managers/scheduler_components/weight_updater.py:187-229
        if not self.session:
            return False, ("update_weights_from_distributed must run between begin_weight_update() and "
                           "end_weight_update()")
        if body.get("load_format") not in (None, "flattened_bucket"):
            return False, f"the stand-in receives load_format None or flattened_bucket, not {body['load_format']!r}"
        try:
            receive = self._receive_flattened if body.get("load_format") == "flattened_bucket" else self._receive
            weights = receive(body["names"], body["dtypes"], body["shapes"], body["group_name"])
        except Exception as exc:  # noqa: BLE001
            return False, f"Failed to receive weights: {exc}"
        self.received.update(weights)
        self.load_formats.append(body.get("load_format"))
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        return True, "Succeeded to update parameter online."

    def _receive(self, names, dtypes, shapes, group_name):
        import torch
        import torch.distributed as dist

        # model_runner_components/weight_updater.py:260-298 (`receive_weights_from_distributed`), device "cpu"
        assert group_name in self.groups, f"Group {group_name} not in {list(self.groups)}."
        group = self.groups[group_name]
        weights, handles = [], []
        for name, dtype, shape in zip(names, dtypes, shapes):
            weight = torch.empty(shape, dtype=getattr(torch, dtype), device="cpu")
            handles.append(dist.broadcast(weight, src=0, group=group, async_op=True))
            weights.append((name, weight))
        for handle in handles:
            handle.wait()
        return weights

    def _receive_flattened(self, names, dtypes, shapes, group_name):
        import torch.distributed as dist

        # weight_updater.py:275-277 and 299-308 (`_receive_bucketed_weights_from_distributed`), device "cpu":
        # SGLang's own FlattenedTensorBucket lays the bytes out and takes them apart
        assert group_name in self.groups, f"Group {group_name} not in {list(self.groups)}."
        bucket = self.sglang.FlattenedTensorBucket.empty(names, dtypes, shapes, "cpu")
        dist.broadcast(bucket.get_flattened_tensor(), src=0, group=self.groups[group_name])
        return [(name, tensor.clone()) for name, tensor in bucket.reconstruct_tensors()]


def serve(host: str, port: int) -> None:
    engine = _Engine()
    lock = threading.Lock()  # one weight operation at a time, as on SGLang's scheduler

    def session(opening: bool) -> tuple[bool, str]:
        if engine.session == opening:
            return False, "a weight-update session is already open" if opening else "no weight-update session is open"
        engine.session = opening
        return True, "Success"

    def received(body: dict) -> tuple[bool, str]:
        import torch

        torch.save({"tensors": engine.received, "weight_version": engine.weight_version,
                    "load_formats": engine.load_formats}, body["path"])
        return True, "saved"

    routes = {
        "/init_weights_update_group": engine.init_weights_update_group,  # many ranks rendezvous: not under the lock
        "/destroy_weights_update_group": engine.destroy_weights_update_group,
        "/update_weights_from_distributed": engine.update_weights_from_distributed,
        "/begin_weight_update": lambda body: session(True),
        "/end_weight_update": lambda body: session(False),
        "/received": received,
    }

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._answer(200, {"status": "ok"} if self.path == "/health" else {"error": "not found"})

        def do_POST(self) -> None:
            route = routes.get(self.path)
            if route is None:
                return self._answer(404, {"error": f"no route {self.path}"})
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path == "/init_weights_update_group":
                ok, message = route(body)
            else:
                with lock:
                    ok, message = route(body)
            self._answer(200, {"success": ok, "message": message})

        def _answer(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt, *args) -> None:
            print(f"{self.address_string()} {fmt % args}", flush=True)

    server = ThreadingHTTPServer((host, port), Handler)
    print(f"SGLang {SGLANG_VERSION} stand-in engine on http://{host}:{port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="role", required=True)
    engine_args = sub.add_parser("engine", help="serve the engine stand-in")
    engine_args.add_argument("--host", default="127.0.0.1")
    engine_args.add_argument("--port", type=int, required=True)
    join = sub.add_parser("join", help="join a group as one rank, receive broadcasts (tests of the pinned copy)")
    join.add_argument("--which", choices=("sglang", "pinned"), required=True)
    join.add_argument("--init-method", required=True)
    join.add_argument("--world-size", type=int, required=True)
    join.add_argument("--rank", type=int, required=True)
    join.add_argument("--shapes", required=True, help="JSON list of shapes")
    join.add_argument("--out", required=True)
    spans = sub.add_parser("weight-versions", help="print SGLang's meta_info for JSON [events, version, tokens]")
    spans.add_argument("request")
    cli = parser.parse_args()
    if cli.role == "engine":
        serve(cli.host, cli.port)
    elif cli.role == "weight-versions":
        print(json.dumps(weight_versions_meta(*json.loads(cli.request))))
    else:
        _join_and_receive(cli.which, cli.init_method, cli.world_size, cli.rank, json.loads(cli.shapes), cli.out)
