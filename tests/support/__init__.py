"""What the tests share, one module per subject; what the benchmarks share with them (the
environment, the objects they create, the polling helper) is in `preshard_devenv`."""
