"""``python -m numguard``: see :mod:`numguard.cli`."""
import sys

from .cli import main

sys.exit(main())
