"""Errors kopt raises on bad input. Each names the problem; none leaves the user's model changed."""

from __future__ import annotations


class KoptError(Exception):
    """Base class of every error kopt raises on purpose."""


class CaptureError(KoptError):
    """The model could not be captured to a single graph.

    ``kind`` is one of ``data-dependent control flow``, ``unsupported operation``,
    ``dynamic shapes``, ``input mutation``, ``capture failed``; ``where`` is the user's source
    line, if known.
    """

    def __init__(self, kind: str, detail: str, where: str | None = None) -> None:
        self.kind = kind
        self.detail = detail
        self.where = where
        at = f" at {where}" if where else ""
        super().__init__(
            f"kopt could not capture the model: {kind}{at}: {detail}\n"
            "The original model is unchanged and still runs as before."
        )


class InputMismatchError(KoptError):
    """An optimized module was called with inputs it was not specialised for."""
