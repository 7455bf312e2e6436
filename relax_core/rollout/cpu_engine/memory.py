"""The CPU engine's memory saver: SGLang's `release_memory_occupation` / `resume_memory_occupation`.

In colocate on shared GPUs an SGLang engine started with `--enable-memory-saver`
gives its GPU memory to the trainer while it trains: release frees the memory
of the given tags ("weights", "kv_cache", "cuda_graph"; none given: all),
resume maps memory again. This engine does the same with its process memory:

- weights: every parameter's storage is freed and what the allocator keeps is
  handed back to the OS (glibc's `malloc_trim`), so the engine's RSS drops by
  about the model's size. Resumed, each parameter is zeros of its shape and
  dtype until the next weight update: SGLang's resumed weights hold whatever
  the memory held (unless started with `--enable-weights-cpu-backup`); zeros
  make a forgotten update show at once.
- kv_cache: the running batch's buffers (an idle engine holds none: its KV
  cache lives only while requests decode) and the allocator's free memory.
- cuda_graph: nothing to free on CPU; tracked like the others.

The rules a caller must follow are SGLang's, enforced here where SGLang would
compute on freed memory: release only an idle engine; while any tag is
released, generation is refused (503); while the weights are released, weight
updates are refused (the order is resume weights -> update weights -> resume
kv_cache). Without `--enable-memory-saver` both endpoints are refused: SGLang
would answer 200 and free nothing, the mistake this stand-in should catch.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import torch

from relax_core.rollout.cpu_engine.kv_batch import KVBatch

NOT_IDLE = "release_memory_occupation should be called only when server is idle."


class MemoryReleased(RuntimeError):
    """A request needs memory that is released."""


class MemorySaver:
    """The released tags and the shapes of released weights.

    `released` changes on the HTTP loop only (before a release runs, so no
    request admitted later sees the memory; after a resume completed);
    `release` and `resume` run on the scheduler thread (`Batcher.call`).
    """

    def __init__(self, model: torch.nn.Module, enabled: bool) -> None:
        self.enabled = enabled
        self.released: set[str] = set()
        self._params = list(model.parameters())  # tied weights once
        self._specs: list[tuple[torch.Size, torch.dtype]] = []

    def problem(self, tags: frozenset[str], resume: bool) -> str | None:
        """Why releasing (resuming) `tags` is refused, or None."""
        if not self.enabled:
            return "memory release needs the engine started with --enable-memory-saver (as SGLang does)"
        if resume and not tags <= self.released:
            return f"cannot resume {sorted(tags - self.released)}: not released"
        return None

    def check_serving(self) -> None:
        if self.released:
            raise MemoryReleased(f"memory {sorted(self.released)} is released; call /resume_memory_occupation first")

    def release(self, batcher, tags: frozenset[str]) -> None:
        if not batcher.is_idle():
            raise RuntimeError(NOT_IDLE)
        if "weights" in tags:
            self._specs = [(p.shape, p.dtype) for p in self._params]
            with torch.inference_mode(False):
                for param in self._params:
                    param.data = torch.empty(0, dtype=param.dtype)
        if "kv_cache" in tags:
            batcher.batch = KVBatch()
        _return_free_memory()

    def resume(self, tags: frozenset[str]) -> None:
        if "weights" in tags:
            with torch.inference_mode(False):
                for param, (shape, dtype) in zip(self._params, self._specs):
                    param.data = torch.zeros(shape, dtype=dtype)
            self._specs = []


def _return_free_memory() -> None:
    """Hand the allocator's free pages back to the OS (glibc; elsewhere freed memory stays mapped)."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
