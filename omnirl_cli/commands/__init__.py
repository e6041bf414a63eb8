"""The command registry: (name, function) pairs, in the order `omnirl --help` lists them."""

from __future__ import annotations

from .advantage import advantage
from .encode import encode
from .env import env
from .export import export
from .init_model import init_model
from .inspect_cmd import inspect
from .logprob import logprob
from .online import online
from .pairs import pairs
from .plan import plan
from .pretrain import pretrain
from .report import report
from .sample import sample
from .score import score
from .serve import serve
from .serve_reward import serve_reward
from .update import update

COMMANDS = [
    ("sample", sample),
    ("score", score),
    ("logprob", logprob),
    ("advantage", advantage),
    ("update", update),
    ("online", online),
    ("pairs", pairs),
    ("encode", encode),
    ("inspect", inspect),
    ("report", report),
    ("init-model", init_model),
    ("plan", plan),
    ("pretrain", pretrain),
    ("export", export),
    ("serve", serve),
    ("serve-reward", serve_reward),
    ("env", env),
]
