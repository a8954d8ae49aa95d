"""``python -m dflash2_kernels.run [options] -- COMMAND ...``: the ``dflash2-run`` launcher
(:mod:`dflash2_kernels_startup.launcher`) under the package's name. The console script
``dflash2-run`` starts faster: it does not import this package, and torch, first."""

import sys

from dflash2_kernels_startup.launcher import main

if __name__ == "__main__":
    sys.exit(main())
