"""``fastdata.synth_coco``: the public name of :mod:`fastdata.tools.synth_coco` (this module *is* that module)."""

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastdata.tools.synth_coco import *  # noqa: F403
else:
    import fastdata.tools.synth_coco as _target

    sys.modules[__name__] = _target
