"""`python -m deployments.cli`: the `raymuter` console script."""

import sys

from . import main

sys.exit(main())
