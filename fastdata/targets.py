"""``fastdata.targets``: the public name of :mod:`fastdata.reader.targets` (this module *is* that module)."""

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastdata.reader.targets import *  # noqa: F403
else:
    import fastdata.reader.targets as _target

    sys.modules[__name__] = _target
