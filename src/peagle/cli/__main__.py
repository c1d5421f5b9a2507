"""`python -m peagle.cli ...`: the `peagle` command where its script is not on the PATH."""

import sys

from . import main

sys.exit(main())
