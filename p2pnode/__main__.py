"""``python -m p2pnode`` runs the command-line interface."""

from p2pnode.cli import main

raise SystemExit(main())
