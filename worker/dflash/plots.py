"""Charts for the bench's and training's reports, drawn only where matplotlib is installed.

matplotlib is the `bench` extra (`pip install 'pg-dflash[bench]'`; `make setup` installs
it), not a dependency of serving: the worker image has no matplotlib, and a drafter trained
there (`dflash serve --learn`, `dflash train`) writes its JSON without the loss chart.
"""

from __future__ import annotations

import sys


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None (said on stderr) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (the bench extra: pip install 'pg-dflash[bench]'): "
              "no chart written", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
