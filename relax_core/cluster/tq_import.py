"""A cheaper import of TransferQueue in every process of a job (its own actors included).

TransferQueue imports tensordict, which marks a few of its functions for
torch.compile as it is imported (`torch.compiler.allow_in_graph`,
`assume_constant_result`). Each mark imports torch's whole compiler: about
2 CPU-seconds, two thirds of what importing TransferQueue costs once torch is
loaded, paid in each of the five or more processes of an asynchronous job that
use the bus (TransferQueue's controller and storage units, the rollout and
field services, the trainer ranks, the driver). On a small node they start
together and share its cores, so the job's start-up waits for them.

Nothing of Relax compiles tensordict's code, so `install()` puts a finder on
`sys.meta_path` that, for the one import of the `tensordict` package, has those
two marks return the function as it is, and restores them right after; code
that compiles later gets torch's own. Where torch's compiler is loaded already
(it costs nothing more then) the import is left alone. Every Ray worker of the
job runs `install` as it starts (`WORKER_SETUP`, the runtime environment's
`worker_process_setup_hook`), before anything is imported; it imports nothing
itself.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

WORKER_SETUP = {"worker_process_setup_hook": "relax_core.cluster.tq_import.install"}


def _as_it_is(fn):
    return fn


class _TensordictFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "tensordict":
            return None
        uninstall()
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module) -> None:
            if "torch._dynamo" in sys.modules:
                return run_module(module)
            import torch.compiler as compiler

            marks = compiler.allow_in_graph, compiler.assume_constant_result
            compiler.allow_in_graph = compiler.assume_constant_result = _as_it_is
            try:
                run_module(module)
            finally:
                compiler.allow_in_graph, compiler.assume_constant_result = marks

        spec.loader.exec_module = exec_module
        return spec


_FINDER = _TensordictFinder()


def install() -> None:
    """Before tensordict is imported in this process: its import skips torch's compiler (see above)."""
    if "tensordict" not in sys.modules and _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
