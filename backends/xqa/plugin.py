"""pluggy entry point of the built-in xqa backend.  Cheap to import; never raises."""

from attncore.hooks import hookimpl


@hookimpl
def attncore_backends():
    try:
        from .backend import XqaBackend

        return [XqaBackend()]
    except Exception:  # a broken install must not break attncore's import
        return []
