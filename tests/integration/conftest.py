"""Registers the session fixtures of engine_fixtures.py once for every integration module.

A fixture imported into a test module belongs to that module: every module importing
`tiny_model_dir` builds the model again, and an engine fixture imported that way would
start one engine server per module. Registered here, each exists once per session.
"""

from engine_fixtures import engine, tiny_model_dir  # noqa: F401
from webhook import webhook  # noqa: F401
