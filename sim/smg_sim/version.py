"""The version of smg-sim, in a module of its own so that modules of the package can read it without a cycle."""

__version__ = "0.1.0"
