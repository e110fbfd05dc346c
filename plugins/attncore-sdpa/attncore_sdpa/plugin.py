"""Entry point module (``attncore.backends: sdpa = "attncore_sdpa.plugin"``).

Keep it cheap: attncore imports it when its registry first loads.
"""

from attncore import hookimpl

from .backend import SdpaBackend


@hookimpl
def attncore_backends():
    return [SdpaBackend()]
