import sys

from qkov_lib.tooling.cli import main

sys.exit(main())
