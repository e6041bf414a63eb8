"""score stage.

`REMOTE_PREFIX` lives here, below both `registry` (which resolves reward names) and `remote` (the
client it names), so neither imports the other for it.
"""

REMOTE_PREFIX = "remote:"  # `remote:URL` names a reward server (stages.score.remote)
