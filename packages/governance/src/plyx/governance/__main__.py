import sys

from plyx.governance._cli import main

sys.exit(main())
