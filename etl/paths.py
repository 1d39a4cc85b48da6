"""Where the ETL commands write: :func:`recpipe.paths.check_output`, re-exported.

The check lives in :mod:`recpipe.paths` (standard library only), where the trainer's commands,
which never import ``etl``, call it too; the ETL's call sites import it from here.
"""

from __future__ import annotations

from recpipe.paths import OutputKind, check_output

__all__ = ["OutputKind", "check_output"]
