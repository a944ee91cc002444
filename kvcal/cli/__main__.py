"""``python -m kvcal.cli``: the ``kvcal`` command."""

import sys

from kvcal.cli import main

sys.exit(main())
