"""``python -m attncore.cli``."""

import sys

from attncore.cli.main import main

sys.exit(main())
