"""Entry point of the built-in reference backend (registered like any plugin)."""

from ..hooks import hookimpl


@hookimpl
def attncore_backends():
    from .backend import ReferenceBackend

    return [ReferenceBackend()]
