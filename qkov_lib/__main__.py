import sys

from .running import main

sys.exit(main())
