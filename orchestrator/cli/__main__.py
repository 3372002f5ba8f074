"""``python -m orchestrator.cli``: the ``pdserve`` command line."""

import sys

from orchestrator.cli.main import main

sys.exit(main())
