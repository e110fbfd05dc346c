"""pluggy hook specifications.  A plugin is a module (named by an ``attncore.backends`` entry point)
that implements ``attncore_backends`` with the ``attncore.hookimpl`` marker."""

import pluggy

hookspec = pluggy.HookspecMarker("attncore")
hookimpl = pluggy.HookimplMarker("attncore")


class AttncoreSpec:
    @hookspec
    def attncore_backends(self):
        """Return a list of ``attncore.core.backend.Backend`` instances this plugin provides.

        Called once per process when the registry first loads.  Keep it cheap: import heavy
        dependencies (compilers, GPU libraries) lazily, and report their absence through
        ``Backend.available()`` rather than by raising.
        """
