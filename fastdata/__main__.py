"""``python -m fastdata`` -> the CLI (also the entry point torchrun launches)."""

import sys

from .cli import main

sys.exit(main())
