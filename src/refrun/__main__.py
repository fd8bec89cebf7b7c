import sys

from refrun.cli import main

sys.exit(main())
