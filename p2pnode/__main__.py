"""``python -m p2pnode`` runs the command-line interface."""

from p2pnode.cli.main import main

raise SystemExit(main())
