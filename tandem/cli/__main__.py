import sys

from tandem.cli.commands import main

sys.exit(main())
