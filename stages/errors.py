"""Errors a user can cause, each carrying the exit code the CLI maps it to.

A message says what went wrong, where (file, column, row, option) and what to do, on one line.
"""

from __future__ import annotations


class OmnirlError(Exception):
    """Base class of the errors the CLI reports as one line (exit code `exit_code`)."""

    exit_code = 1


class UserInputError(OmnirlError):
    """Bad usage or bad input: unreadable shard, schema mismatch, missing column, unknown name."""

    exit_code = 2


class CorruptShardError(UserInputError):
    """A shard file whose bytes do not match its manifest, or that cannot be decoded."""


class CorruptRowError(CorruptShardError):
    """One row's stored media (an MP4, a PNG) cannot be decoded. `column` and `row` (the row's index in
    its shard) let the command that read the shard name its file (`stages.outputs.map_shards`)."""

    def __init__(self, column: str, row: int, message: str) -> None:
        super().__init__(message)
        self.column = column
        self.row = row


class NonFiniteError(UserInputError):
    """NaN or inf in rewards, log-probs or losses: never trained on silently."""


class RuntimeFailure(OmnirlError):
    """A failure of the run itself (a worker died, a remote server kept failing)."""

    exit_code = 1
