import sys

from .hub_export.cli import main

sys.exit(main())
