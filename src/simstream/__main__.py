"""``python -m simstream``: the same as the ``simstream`` console script."""

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
