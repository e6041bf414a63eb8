"""`python -m omnirl_cli` runs the `omnirl` command."""

from omnirl_cli.app import main

main()
