import sys

from fashionjax.cli import main

sys.exit(main())
