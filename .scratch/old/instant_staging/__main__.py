"""``python -m instant_staging``: the command line (``instant_staging.cli``)."""

import sys

from instant_staging.cli import main

if __name__ == "__main__":
    sys.exit(main())
