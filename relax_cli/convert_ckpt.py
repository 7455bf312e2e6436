"""`relax convert-ckpt CKPT --out DIR [--iteration N] [--verify]`: Megatron-format checkpoint to Hugging Face."""

from __future__ import annotations

from pathlib import Path

import typer

from relax_cli.common import out


def convert_ckpt(
    ckpt: Path = typer.Argument(..., help="Checkpoint folder (holds latest_checkpointed_iteration.txt) or a run directory."),
    out_dir: Path = typer.Option(..., "--out", help="Folder to write the Hugging Face model to."),
    iteration: int = typer.Option(None, "--iteration", help="Iteration to convert (default: the latest)."),
    verify: bool = typer.Option(False, "--verify", help="Compare the converted model's logits with the checkpoint's."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output folder."),
) -> None:
    """Write safetensors, config, tokenizer and generation config that transformers loads as-is."""
    from relax_core.checkpoint.convert import convert

    report = convert(ckpt, out_dir, iteration=iteration, verify=verify, overwrite=overwrite)
    out.print(f"wrote {report['out_dir']} (iteration {report['iteration']})", markup=False)
    if verify:
        out.print(f"[green]verified[/]: max |logit difference| {report['max_abs_diff']:.3g} "
                  f"<= {report['atol']:g} on {report['tokens']} tokens")
