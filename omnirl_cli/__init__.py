"""The `omnirl` command line: a thin Typer shell around `stages`."""
