"""Entry point of the built-in reference backend (registered like any plugin)."""

from attncore.core.hooks import hookimpl


@hookimpl
def attncore_backends():
    from attncore.reference.backend import ReferenceBackend

    return [ReferenceBackend()]
