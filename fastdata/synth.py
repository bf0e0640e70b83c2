"""``fastdata.synth``: the public name of :mod:`fastdata.tools.synth` (this module *is* that module)."""

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastdata.tools.synth import *  # noqa: F403
else:
    import fastdata.tools.synth as _target

    sys.modules[__name__] = _target
