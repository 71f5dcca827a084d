"""``python -m mambakv``: the ``mambakv`` command (see :mod:`mambakv.cli`)."""

import sys

from mambakv.cli import main

if __name__ == "__main__":
    sys.exit(main())
