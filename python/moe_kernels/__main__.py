"""`python -m moe_kernels ...`: see moe_kernels.cli."""
import sys

from .cli import main

sys.exit(main())
