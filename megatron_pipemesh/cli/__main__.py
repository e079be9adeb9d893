"""``python -m megatron_pipemesh.cli``."""
import sys

from . import main

sys.exit(main())
