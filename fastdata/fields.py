"""``fastdata.fields``: the public name of :mod:`fastdata.format.fields` (this module *is* that module)."""

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastdata.format.fields import *  # noqa: F403
else:
    import fastdata.format.fields as _target

    sys.modules[__name__] = _target
