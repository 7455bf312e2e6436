"""TransferQueue bytes per step of the sample bus, in this commit's encoding and an older one's.

Two steps' worth of rows:
  (a) one 8k-token text row: a 512-token prompt and an 8192-token response (ids of a 151,936-token
      vocabulary), its log-probs and loss mask, each token's policy version (a weight update landed
      half-way; the older encoding had no such column), and the reference service's log-probs column;
  (b) a group of 8 image samples of one prompt (600 prompt and 512 response tokens each) sharing the
      processor's tensors of one 448x448 image as Qwen2-VL makes them: 32x32 patches of 14 pixels,
      2 frames x 3 channels x 14 x 14 = 1176 values each, so `pixel_values` [1024, 1176] float32
      (4.8 MB) and `image_grid_thw` [[1, 32, 32]] (random values: only the sizes matter).

Each encoding's own `SampleBus.put` and `SampleBus.write` run against a client that records the
TensorDicts they hand TransferQueue; each TensorDict then goes through TransferQueue's own put path
to one storage unit (`AsyncSimpleStorageManager._select_by_positions` per column, the PUT_DATA
`ZMQMessage` and its `serialize`), and the figures are:
  - put_bytes: the bytes of the serialized frames, what TransferQueue sends (and logs as
    `serialized_bytes`);
  - held_bytes: what a storage unit keeps of it once decoded (its `_handle_put` stores the decoded
    values row by row): tensors and bytes by their size, Python lists, numbers and strings by
    `sys.getsizeof`, summed over the objects (each once).
The older encoding is relax_core/data/bus.py at `--old-ref` (default 91c9c32, before packed token
columns and media once per group), loaded from git. The last line is one JSON object.

    python tests/benchmarks/bench_bus_bytes.py [--old-ref 91c9c32]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from relax_core.data import bus as new_bus
from relax_core.data.bus import import_tq
from relax_core.data.sample import Sample

REPO = Path(__file__).resolve().parents[2]
VOCAB = 151_936


class Meta:
    """What `SampleBus.put` and `write` ask of TransferQueue's `BatchMeta`: a size, custom meta to set."""

    def __init__(self, size: int):
        self.size = size

    def update_custom_meta(self, rows) -> None:
        pass


class Recorder:
    """A TransferQueue client that keeps the TensorDicts it is given to put."""

    def __init__(self):
        self.puts = []

    def get_meta(self, batch_size: int, **_) -> Meta:
        return Meta(batch_size)

    def kv_retrieve_meta(self, keys, **_) -> Meta:
        return Meta(len(keys))

    def set_custom_meta(self, meta) -> None:
        pass

    def put(self, data, metadata) -> None:
        self.puts.append(data)


def load_bus(ref: str):
    """relax_core/data/bus.py as of git commit `ref`, as a module."""
    source = subprocess.run(["git", "show", f"{ref}:relax_core/data/bus.py"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / f"bus_{ref}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"bus_{ref}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def held(obj, seen: set[int]) -> int:
    """Bytes a decoded value occupies: tensors by their data, containers and their items by getsizeof,
    each object once (`seen`: Python shares the small ints, 0 and 1 of a loss mask, among all rows)."""
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return obj.element_size() * obj.numel()
    if isinstance(obj, (list, tuple)):
        return sys.getsizeof(obj) + sum(held(x, seen) for x in obj)
    if isinstance(obj, dict):
        return sys.getsizeof(obj) + sum(held(k, seen) + held(v, seen) for k, v in obj.items())
    return sys.getsizeof(obj)


def tq_bytes(data) -> tuple[int, int]:
    """(put_bytes, held_bytes) of one TensorDict put to one storage unit, through TransferQueue's own code."""
    from transfer_queue.storage.managers.simple_storage_manager import AsyncSimpleStorageManager
    from transfer_queue.utils.zmq_utils import ZMQMessage, ZMQRequestType

    n = data.batch_size[0]
    rows = {f: AsyncSimpleStorageManager._select_by_positions(data[f], list(range(n))) for f in data.keys()}
    message = ZMQMessage.create(request_type=ZMQRequestType.PUT_DATA, sender_id="client", receiver_id="unit",
                                body={"global_indexes": list(range(n)), "data": rows, "data_parser": None})
    frames = message.serialize()
    stored = ZMQMessage.deserialize([bytes(memoryview(f)) for f in frames]).body["data"]
    return sum(memoryview(f).nbytes for f in frames), held(list(stored.values()), set())


def step_bytes(module, samples: list[Sample], ref_logprobs: list[list[float]] | None) -> dict[str, int]:
    """TransferQueue bytes of putting `samples` with `module`'s bus (and writing their reference column)."""
    client = Recorder()
    bus = module.SampleBus(client, owner=False)
    bus.put(0, samples)
    if ref_logprobs is not None:
        bus.write(Meta(len(samples)), "ref_logprobs", ref_logprobs, "reference")
    sizes = [tq_bytes(data) for data in client.puts]
    return {"put_bytes": sum(s[0] for s in sizes), "held_bytes": sum(s[1] for s in sizes)}


def text_row(rng: random.Random) -> tuple[list[Sample], list[list[float]]]:
    response = 8192
    row = Sample(prompt_ids=[rng.randrange(VOCAB) for _ in range(512)],
                 response_ids=[rng.randrange(VOCAB) for _ in range(response)],
                 rollout_logprobs=[-rng.random() * 10 for _ in range(response)],
                 loss_mask=[1] * response, reward=1.0, group_id=1, policy_version=3, label="42",
                 metadata={"source": "math"}, finish_reason="length", sample_id=10)
    if hasattr(row, "token_versions"):  # an update landed half-way: this encoding keeps each token's version
        row.token_versions = [3] * (response // 2) + [4] * (response - response // 2)
    return [row], [[-rng.random() * 10 for _ in range(response)]]


def image_group(rng: random.Random) -> list[Sample]:
    media = {"pixel_values": torch.randn(1024, 3 * 2 * 14 * 14), "image_grid_thw": torch.tensor([[1, 32, 32]])}
    prompt = [rng.randrange(VOCAB) for _ in range(600)]
    return [Sample(prompt_ids=prompt, response_ids=[rng.randrange(VOCAB) for _ in range(512)],
                   rollout_logprobs=[-rng.random() * 10 for _ in range(512)], reward=float(k % 2), group_id=2,
                   policy_version=3, label="cat", metadata={"source": "vqa"}, finish_reason="stop",
                   sample_id=20 + k, multimodal=media) for k in range(8)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old-ref", default="91c9c32", help="the commit whose bus.py is the older encoding")
    args = parser.parse_args()
    import_tq()
    old_bus = load_bus(args.old_ref)
    rng = random.Random(0)
    text, ref = text_row(rng)
    images = image_group(rng)
    pixels = images[0].multimodal["pixel_values"]
    result = {"old_ref": args.old_ref, "pixel_values_bytes": pixels.element_size() * pixels.numel()}
    for case, samples, ref_logprobs in [("text_8k_row", text, ref), ("image_group_of_8", images, None)]:
        old = step_bytes(old_bus, samples, ref_logprobs)
        new = step_bytes(new_bus, samples, ref_logprobs)
        for key in ("put_bytes", "held_bytes"):
            print(f"{case:17s} {key:10s} before {old[key] / 2**20:8.2f} MiB  after {new[key] / 2**20:8.2f} MiB  "
                  f"({old[key] / new[key]:.1f}x smaller)")
        result[case] = {"before": old, "after": new}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
