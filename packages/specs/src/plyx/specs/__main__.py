import sys

from plyx.specs.cli import main

sys.exit(main())
