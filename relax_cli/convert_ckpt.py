"""`relax convert-ckpt CKPT --out DIR [--iteration N] [--verify]`: Megatron-format checkpoint to Hugging Face."""

from __future__ import annotations

from pathlib import Path

import typer

from relax_cli.common import out


def convert_ckpt(
    ckpt: Path = typer.Argument(
        ..., help="Checkpoint folder (holds latest_checkpointed_iteration.txt) or a run directory."),
    out_dir: Path = typer.Option(..., "--out", help="Folder to write the Hugging Face model to."),
    iteration: int = typer.Option(None, "--iteration", help="Iteration to convert (default: the latest)."),
    verify: bool = typer.Option(False, "--verify", help="Compare the converted model's logits with the checkpoint's."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output folder."),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code",
                                           help="With --verify: let a model that ships its own code run it."),
    slurm: bool = typer.Option(
        False, "--slurm", help="Run the conversion as a one-node Slurm job (submitit) and wait."),
    partition: str = typer.Option(None, "--partition", help="With --slurm: partition."),
    account: str = typer.Option(None, "--account", help="With --slurm: account."),
    time_min: int = typer.Option(60, "--time-min", help="With --slurm: time limit in minutes."),
    cpus: int = typer.Option(4, "--cpus", help="With --slurm: CPU cores."),
    mem_gb: int = typer.Option(None, "--mem-gb", help="With --slurm: memory in GB (partition default if unset)."),
) -> None:
    """Write safetensors, config, tokenizer and generation config that transformers loads as-is."""
    from relax_core.checkpoint.convert import check_source, convert

    check_source(ckpt, iteration)  # a missing or damaged checkpoint fails here, before any job is submitted
    if slurm:
        from relax_core.launch.remote import run_on_slurm

        folder = out_dir.expanduser().resolve().with_name(out_dir.name + ".submitit")
        report = run_on_slurm(convert, ckpt.resolve(), out_dir.expanduser().resolve(), folder=folder,
                              job_name="relax-convert-ckpt", partition=partition, account=account,
                              time_min=time_min, cpus=cpus, mem_gb=mem_gb, echo=lambda m: out.print(m, markup=False),
                              iteration=iteration, verify=verify, overwrite=overwrite,
                              trust_remote_code=trust_remote_code)
    else:
        report = convert(ckpt, out_dir, iteration=iteration, verify=verify, overwrite=overwrite,
                         trust_remote_code=trust_remote_code)
    out.print(f"wrote {report['out_dir']} (iteration {report['iteration']})", markup=False)
    if verify:
        out.print(f"[green]verified[/]: max |logit difference| {report['max_abs_diff']:.3g} "
                  f"<= {report['atol']:g} on {report['tokens']} tokens")
