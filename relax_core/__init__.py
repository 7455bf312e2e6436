"""Relax: asynchronous RL post-training engine for language and omni-modal models.

Sub-packages, in data-flow order: `config` (recipes), `launch` (Slurm and local
executors), `entrypoints` (the processes that bring up a cluster and start the
controller), `cluster` (node bring-up), `controller` (training loops),
`rollout` (engines and sampling), `rewards`, `algorithms`, `train`, `weights`
(weight sync), `checkpoint`, `metrics`. Importing this package imports nothing
heavy; torch, ray and transformers load inside the modules that need them.
"""

__version__ = "0.1.0"
