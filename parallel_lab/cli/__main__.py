"""``python -m parallel_lab.cli``: the same as the ``parallel-lab`` command."""

import sys

from . import main

sys.exit(main())
