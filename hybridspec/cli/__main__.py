"""``python -m hybridspec.cli``: the command line (``hybridspec.cli.main``)."""

import sys

from hybridspec.cli import main

sys.exit(main())
