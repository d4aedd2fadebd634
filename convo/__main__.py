"""``python -m convo`` = ``convo``."""

import sys

from convo.cli import main

sys.exit(main())
