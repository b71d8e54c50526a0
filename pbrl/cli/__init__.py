"""The ``pbrl`` command (docs/design/architecture.md#front-doors): the commands in :mod:`pbrl.cli.commands`,
``label`` in :mod:`pbrl.cli.label`, ``serve``, ``deploy`` and ``models`` in :mod:`pbrl.cli.setup`, what they print
in :mod:`pbrl.cli.display`. ``app`` is the entry point (``pbrl = "pbrl.cli:app"``).
"""

from pbrl.cli.commands import app

__all__ = ["app"]
