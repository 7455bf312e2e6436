"""The `relax` entry point: builds the typer app from one module per command."""

from __future__ import annotations

import gc
import os
import sys

import typer

from relax_cli import (
    cancel,
    convert_ckpt,
    doctor,
    listing,
    logs,
    plot,
    recipes,
    reward,
    scale_rollout,
    status,
    submit,
    validate,
)

app = typer.Typer(
    name="relax",
    help="Relax: asynchronous RL post-training for language and omni-modal models on Slurm.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("submit")(submit.submit)
app.command("status")(status.status)
app.command("logs")(logs.logs)
app.command("plot")(plot.plot)
app.command("cancel")(cancel.cancel)
# "-1" is a change, not an option: unknown options reach the arguments
app.command("scale-rollout", context_settings={"ignore_unknown_options": True})(scale_rollout.scale_rollout)
app.command("convert-ckpt")(convert_ckpt.convert_ckpt)
app.command("validate")(validate.validate)
app.command("recipes")(recipes.recipes)
app.command("list")(listing.list_names)
app.command("doctor")(doctor.doctor)
app.add_typer(reward.app, name="reward")


def main() -> None:
    """Run the CLI; user mistakes exit with 2, runtime failures with 1."""
    from relax_cli.common import EXIT_RUNTIME_ERROR, EXIT_USER_ERROR, fail
    from relax_core.errors import UserError

    try:
        app()
    except UserError as exc:
        fail(str(exc), EXIT_USER_ERROR)
    except Exception as exc:  # a runtime failure: short message, traceback on request
        if os.environ.get("RELAX_DEBUG"):
            raise
        fail(f"{type(exc).__name__}: {exc} (set RELAX_DEBUG=1 for the traceback)", EXIT_RUNTIME_ERROR)
    finally:
        # The process ends now: spare the interpreter's final garbage collections a walk over the
        # hundreds of thousands of objects torch, transformers and Ray made (seconds after a local run).
        gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
