"""`python -m train`: see `train.cli`."""

import sys

from train.cli import main

if __name__ == "__main__":
  sys.exit(main())
