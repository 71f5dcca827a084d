"""The ``mambakv`` command (``mambakv = mambakv.cli:main``): its parser and entry point
(:mod:`mambakv.cli.main`), the run commands replay / trace / chat (:mod:`~mambakv.cli.runs`),
``sweep`` (:mod:`~mambakv.cli.sweep`), ``fleet`` (:mod:`~mambakv.cli.fleet`), argument types
(:mod:`~mambakv.cli.args`), the reports (:mod:`~mambakv.cli.report`,
:mod:`~mambakv.cli.fleet_report`) and the charts (:mod:`~mambakv.cli.plot`). The simulator it runs
is :mod:`mambakv.sim`, imported only once a command runs."""

from mambakv.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
