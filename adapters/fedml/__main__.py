"""``python -m fedplug.adapters.fedml run CONFIG --out DIR``: see :mod:`.launcher`."""

import sys

from .launcher import main

sys.exit(main())
