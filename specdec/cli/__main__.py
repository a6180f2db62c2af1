"""`python -m specdec.cli ...`, the same as the `specdec` command."""
from specdec.cli.app import main

main()
