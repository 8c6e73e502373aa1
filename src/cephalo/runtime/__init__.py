"""Sharded data-parallel runtime: collectives (`comm`), process groups (`dist`), the memory
ledger (`memory`), the parameter-group rule (`param_groups`), flat buffers and the engine."""
