"""`python -m numpy_attention` is the `numpy-attention` command."""
import sys

from .cli import main

sys.exit(main())
