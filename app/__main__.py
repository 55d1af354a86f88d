"""`python -m app`: start Inference Lab (see app.main for the options)."""

import sys

from app.main import main

sys.exit(main())
