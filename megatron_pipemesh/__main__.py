"""``python -m megatron_pipemesh``: the ``pipemesh`` command."""
import sys

from .command import main

sys.exit(main())
