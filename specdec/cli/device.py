"""Devices: `devices` (profiles, this machine, a suggestion) and `build-engines` (TensorRT engines for this GPU)."""
from __future__ import annotations

import time
from pathlib import Path

import click

from specdec.cli.common import friendly


@click.command()
@click.option("--bundle", type=click.Path(path_type=Path), default=None,
              help="Also show the memory arithmetic (weights + KV + workspace) for this bundle on every profile.")
@click.option("--notes", is_flag=True, help="Also print the reason behind each profile's numbers.")
@friendly
def devices(bundle, notes):
    """List device profiles, detect this machine and suggest one."""
    from specdec.devices.report import render

    click.echo(render(bundle, notes=notes))


@click.command("build-engines")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--device", default=None, metavar="PROFILE",
              help="GPU profile: TensorRT options and KV length (default: the one `specdec devices` suggests).")
@click.option("--max-len", type=int, default=None, help="KV buffer length in tokens (default: the profile's).")
@click.option("--rebuild", is_flag=True, help="Delete BUNDLE/trt_cache first (engines of another GPU or TensorRT).")
@friendly
def build_engines_cmd(bundle, device, max_len, rebuild):
    """Build BUNDLE's TensorRT engines on this GPU into BUNDLE/trt_cache and record what built them.

    Engines are tied to one GPU model and TensorRT version: build them on the device that runs the bundle.
    Without this, the first TensorRT run builds them (minutes).
    """
    from specdec.devices.setup import TRT_CACHE, build_engines

    t0 = time.perf_counter()
    record = build_engines(bundle, device=device, max_len=max_len, rebuild=rebuild)
    click.echo(f"TensorRT engines for {', '.join(record.graphs)} in {Path(bundle) / TRT_CACHE} "
               f"({record.builder.describe()}) in {time.perf_counter() - t0:.0f} s")


COMMANDS = (devices, build_engines_cmd)
