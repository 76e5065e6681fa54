"""One module per kernel: the op's math in a docstring, its reference, its registration."""
