"""``python -m kvsvc``: same as the ``kvsvc`` command."""

from kvsvc.cli import main

raise SystemExit(main())
