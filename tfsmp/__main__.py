import sys

from tfsmp.launch.cli import main

sys.exit(main())
