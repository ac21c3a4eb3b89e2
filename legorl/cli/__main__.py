"""`python -m legorl.cli` runs the CLI."""

import sys

from legorl.cli.main import main

sys.exit(main())
