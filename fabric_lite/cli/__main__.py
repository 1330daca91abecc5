import sys

from fabric_lite.cli.main import main

sys.exit(main())
