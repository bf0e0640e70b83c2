"""``python -m fastdata`` -> the CLI (also the entry point torchrun launches)."""

import sys

from fastdata.cli.main import main

sys.exit(main())
