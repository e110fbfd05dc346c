"""pluggy entry point of the built-in xqa backend.  Cheap to import."""

from attncore.core.hooks import hookimpl


@hookimpl
def attncore_backends():
    # an import error propagates: the registry lists the backend as unavailable with the reason
    from attncore.backends.xqa.backend import XqaBackend

    return [XqaBackend()]
