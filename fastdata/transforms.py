"""``fastdata.transforms``: the public name of :mod:`fastdata.reader.transforms` (this module *is* that module)."""

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastdata.reader.transforms import *  # noqa: F403
else:
    import fastdata.reader.transforms as _target

    sys.modules[__name__] = _target
