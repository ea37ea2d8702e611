"""The `ckptwatch` command, one module per subcommand (main.py dispatches).

Nothing in the product imports this package: it is the people-facing edge.
"""
