"""``python -m hybridspec.cli``: the command line (``hybridspec.cli.main``).

The garbage collector is off while the command line's modules (torch among them) are imported:
every object they make survives, so the full collections on the way would only visit them
again; ``main`` turns it back on (and ``generate`` keeps it off until its engine is built).
"""

import gc
import sys

gc.disable()

from hybridspec.cli import main  # noqa: E402  (after gc.disable, on purpose)

sys.exit(main())
