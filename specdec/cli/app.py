"""The `specdec` command group. Bad input ends with one line saying what is wrong and what to do.

Each command group lives in its own module beside its options and exposes COMMANDS; COMMAND_MODULES lists them,
so a new group is registered by adding its module's name there (command modules never import this one).
"""
from __future__ import annotations

import importlib
import sys

import click

from specdec.cli.common import fail

# The modules whose COMMANDS make up `specdec`; `specdec --help` lists the commands alphabetically.
COMMAND_MODULES = ("specdec.cli.export", "specdec.cli.drafters", "specdec.cli.run", "specdec.cli.quant", "specdec.cli.device",
                   "specdec.cli.serve", "specdec.cli.tune")


class _OneLineErrorGroup(click.Group):
    """Click's own usage errors (bad flag values, unknown options, missing arguments) as one `error:` line too."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.ClickException as e:
            if type(e).__name__ == "NoArgsIsHelpError":  # bare `specdec`: the help is the answer
                e.show()
                sys.exit(e.exit_code)
            ctx = getattr(e, "ctx", None)
            fail(e.format_message() + (f" (see `{ctx.command_path} --help`)" if ctx is not None else ""), e.exit_code)
        except click.Abort:
            click.echo("\ninterrupted", err=True)
            sys.exit(130)
        sys.exit(rv if isinstance(rv, int) else 0)  # an int here is the code of click's Exit (--help, --version)


@click.group(cls=_OneLineErrorGroup)
@click.version_option(package_name="specdec")
def main() -> None:
    """Speculative decoding for LLMs on laptops and edge devices."""


for _name in COMMAND_MODULES:
    for _command in importlib.import_module(_name).COMMANDS:
        main.add_command(_command)
