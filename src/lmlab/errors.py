"""User-facing errors.

Every problem a user can cause (a wrong config, a missing corpus, a corrupt checkpoint ...) is
raised as a subclass of :class:`LmlabError` with one readable sentence. The CLI prints that
sentence to stderr and exits non-zero; anything else is a bug and keeps its traceback under
``--debug``.
"""

from __future__ import annotations


class LmlabError(Exception):
    """Base class of every error whose message is meant for the user."""


class ConfigError(LmlabError, ValueError):
    """A config field is unknown, has the wrong type, or holds a value outside its allowed set."""


class DataError(LmlabError):
    """A corpus or text input is missing, empty, not UTF-8, or cannot be tokenised."""


class CheckpointError(LmlabError):
    """A run folder has no checkpoint, or a checkpoint is incomplete or corrupt."""


class Interrupted(LmlabError):
    """The user stopped a command (Ctrl-C / SIGINT, or SIGTERM) after its state was saved.

    ``exit_code``: what the CLI exits with, 128 + the signal number (130 SIGINT, 143 SIGTERM)."""

    def __init__(self, message: str, exit_code: int = 130) -> None:
        super().__init__(message)
        self.exit_code = exit_code
