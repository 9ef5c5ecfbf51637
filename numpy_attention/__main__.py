"""`python -m numpy_attention` is the `numpy-attention` command."""
import sys

from .commands.cli import main

sys.exit(main())
