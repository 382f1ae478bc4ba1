import sys

from bridge.job.cli import main

if __name__ == "__main__":
    sys.exit(main())
