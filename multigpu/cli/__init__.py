"""The ``multigpu`` command line: one module per subcommand."""
