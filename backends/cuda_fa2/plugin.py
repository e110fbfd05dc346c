"""pluggy entry point of the built-in cuda_fa2 backend.  Cheap to import; never raises."""

from attncore.hooks import hookimpl


@hookimpl
def attncore_backends():
    try:
        from .backend import CudaFa2Backend

        return [CudaFa2Backend()]
    except Exception:  # a broken install must not break attncore's import
        return []
