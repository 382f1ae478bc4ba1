"""`python -m bridge` is `tes-bridge`; the job script and `serve` call it by absolute path."""

import sys

from bridge.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
