"""``python -m parallel_lab``: the same as the ``parallel-lab`` command."""

import sys

from .cli import main

sys.exit(main())
