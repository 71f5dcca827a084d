"""``python -m mambakv.cli``: the ``mambakv`` command."""

import sys

from mambakv.cli.main import main

sys.exit(main())
