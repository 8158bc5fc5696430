import sys

from attnplug.cli.main import main

sys.exit(main())
