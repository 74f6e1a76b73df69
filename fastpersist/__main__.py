"""``python -m fastpersist``: the same as the ``fastpersist`` command (see :mod:`fastpersist.cli`)."""

from __future__ import annotations

import sys

from fastpersist.cli import main

if __name__ == "__main__":
    sys.exit(main())
