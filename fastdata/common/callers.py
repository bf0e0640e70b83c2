"""Where a warning points: at the user's line that called into fastdata, never at fastdata's own code.

``warnings.warn(stacklevel=N)`` counts frames, and a fixed N is right for one call path only: the
same warning reached through ``open_dataset``, a dataset class or a subclass of it sits at another
depth each time (Python 3.12's ``skip_file_prefixes`` does this, but fastdata supports 3.11).
"""

from __future__ import annotations

import os
import sys

#: the fastdata package's directory as its modules' code objects name it (the same form as their
#: ``__file__``: absolute or relative alike), with a separator so that ``fastdata_x/`` is not inside
_PACKAGE_DIR = os.path.dirname(os.path.dirname(__file__)) + os.sep


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes ``warnings.warn``, called by the function that calls this one,
    name the first frame outside the fastdata package: the caller's own line.

    Returns:
        int: 1 when the warning function itself is outside fastdata, else one more per fastdata frame.
    """
    frame = sys._getframe(1)  # the function that warns (stacklevel 1)
    level = 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back
        level += 1
    return level
