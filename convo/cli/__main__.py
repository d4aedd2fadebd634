"""``python -m convo.cli`` = ``convo``."""

import sys

from convo.cli import main

sys.exit(main())
