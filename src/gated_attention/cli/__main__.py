"""`python -m gated_attention.cli ...` = `gattn ...` (the tests spawn the CLI this way)."""
import sys

from gated_attention.cli import main

sys.exit(main())
