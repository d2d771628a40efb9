"""``python -m lmlab`` (also what ``torchrun -m lmlab`` starts)."""

import sys

from lmlab.cli import main

sys.exit(main())
