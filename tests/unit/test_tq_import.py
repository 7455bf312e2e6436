"""TransferQueue's import without torch's compiler (relax_core/cluster/tq_import.py), in fresh processes."""

import json
import subprocess
import sys

PROBE = """
import json, sys
{setup}
import torch.compiler as compiler
before = compiler.allow_in_graph, compiler.assume_constant_result
from relax_core.data.bus import import_tq
tq = import_tq()
import tensordict, torch
td = tensordict.TensorDict({{"x": torch.arange(4.0)}}, batch_size=4)
print(json.dumps({{
    "compiler_loaded": any(m == "torch._dynamo" or m.startswith("torch._dynamo.") for m in sys.modules),
    "marks_restored": (compiler.allow_in_graph, compiler.assume_constant_result) == before,
    "finder_left": any(type(f).__name__ == "_TensordictFinder" for f in sys.meta_path),
    "sum": float(td[1:]["x"].sum()),
    "client": hasattr(tq, "get_client"),
}}))
"""


def probe(setup: str = "") -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE.format(setup=setup)], capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_transferqueue_imports_without_torchs_compiler_and_leaves_torch_as_it_was():
    got = probe()
    assert got == {"compiler_loaded": False, "marks_restored": True, "finder_left": False, "sum": 6.0,
                   "client": True}


def test_where_torchs_compiler_is_loaded_already_the_import_is_left_alone():
    got = probe("import torch._dynamo")
    assert got["compiler_loaded"] and got["marks_restored"] and got["sum"] == 6.0


def test_code_compiled_after_the_import_gets_torchs_own_marks():
    code = ("from relax_core.data.bus import import_tq; import_tq()\n"
            "import torch, torch.compiler as c\n"
            "f = c.allow_in_graph(lambda x: x + 1)\n"
            "import torch._dynamo\n"
            "print(torch._dynamo.allow_in_graph.__module__, f(torch.ones(1)).item())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["torch._dynamo.decorators", "2.0"]
