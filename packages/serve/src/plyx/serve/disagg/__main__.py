"""``python -m plyx.serve.disagg PATH --address HOST:PORT ...``: a prefill worker (started by ``plyx serve
--disaggregate``)."""

import sys

from plyx.serve.disagg._worker import main

sys.exit(main())
