"""pluggy entry point of the built-in cuda_fa2 backend.  Cheap to import."""

from attncore.core.hooks import hookimpl


@hookimpl
def attncore_backends():
    # an import error propagates: the registry lists the backend as unavailable with the reason
    from attncore.backends.cuda_fa2.backend import CudaFa2Backend

    return [CudaFa2Backend()]
