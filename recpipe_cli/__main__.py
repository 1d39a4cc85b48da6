"""``python -m recpipe_cli``: the ``recpipe`` command without the console script."""

from __future__ import annotations

import sys

from recpipe_cli import main

sys.exit(main())
