"""Pure manifest builders: typed input in, manifest dict out, no I/O."""
