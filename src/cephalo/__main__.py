import sys

from cephalo.cli import main

sys.exit(main())
