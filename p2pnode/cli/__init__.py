"""The p2pnode command: cli.main (build_parser, main), one module per command group, the
daemon's process and data-directory lock, and the demo.

May import: public interfaces, hosting, bridges.
"""
