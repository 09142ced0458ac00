import sys

from thinkcraft.cli import main

sys.exit(main())
