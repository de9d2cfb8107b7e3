import sys

from traces.cli import main

sys.exit(main())
