"""`python -m bootstrap`: run a Swarm bootstrap DHT node (see `bootstrap.node.main`)."""

import sys

from bootstrap.node import main

if __name__ == "__main__":
    sys.exit(main())
