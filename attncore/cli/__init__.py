"""The ``attncore`` command and its subcommands: ``main`` (argument parsing, info, explain, build,
conformance), ``check``, ``bench`` and ``tune``."""

from attncore.cli.main import main

__all__ = ["main"]
