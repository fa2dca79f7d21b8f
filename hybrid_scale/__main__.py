"""`python -m hybrid_scale` = the `hybrid-scale` command."""

import sys

from .cli import main

sys.exit(main())
