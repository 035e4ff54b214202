"""`python -m folio [ARGS]`: what the launchers run (process set-up, then `folio`)."""

import sys

from folio.platform_setup import main

sys.exit(main())
