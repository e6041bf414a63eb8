"""omnirl stages: every phase of RL post-training as a library function over in-memory batches.

Nothing in this package imports the command line (`omnirl_cli`).
"""
