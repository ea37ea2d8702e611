"""`python -m monitor.cli ...` is the `ckptwatch` command."""
import sys

from monitor.cli.main import main

sys.exit(main())
