"""``python -m megatron_pipemesh.bench [bench flags]``: the ``pipemesh bench`` subcommand on its own."""
import sys

from .cli import main

sys.exit(main())
