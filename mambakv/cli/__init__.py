"""The ``mambakv`` command (``mambakv = mambakv.cli:main``): its parser and commands
(:mod:`mambakv.cli.main`), argument types (:mod:`~mambakv.cli.args`), the ``fleet`` subcommand
(:mod:`~mambakv.cli.fleet`), the reports (:mod:`~mambakv.cli.report`,
:mod:`~mambakv.cli.fleet_report`) and the charts (:mod:`~mambakv.cli.plot`). The simulator it runs
is :mod:`mambakv.sim`, imported only once a command runs."""

from mambakv.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
