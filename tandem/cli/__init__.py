"""The ``tandem`` command line (:mod:`tandem.cli.commands`; ``tandem serve`` in :mod:`tandem.cli.serve`)."""

from tandem.cli.commands import build_parser, main

__all__ = ["build_parser", "main"]
