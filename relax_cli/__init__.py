"""The `relax` command line: one module per command, no logic beyond argument parsing.

Each command turns its arguments into a call into `relax_core`. Nothing here
imports torch, ray or transformers at import time, so `relax --help` is instant
on a login node.
"""
