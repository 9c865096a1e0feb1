"""``python -m kvconnector.cli``: the same as the ``kvconnector`` command."""

from kvconnector.cli import main

raise SystemExit(main())
