"""``python -m tightfit`` = the ``tightfit`` command."""

import sys

from .cli import main

sys.exit(main())
