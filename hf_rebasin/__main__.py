"""``python -m hf_rebasin``: the same as the ``hf-rebasin`` command."""

import sys

from hf_rebasin.cli import main

if __name__ == "__main__":
    sys.exit(main())
