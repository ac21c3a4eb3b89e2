"""`python -m legorl.trainer`: the trainer pod's entrypoint (same as `legorl train`)."""

import sys

from legorl.trainer.main import main

sys.exit(main())
