"""The `titanctl` binary: one module per subcommand, which parses its options, calls the core and prints
(``console``: the shared output). No logic of its own."""
