"""mobius-fed: Möbius Learning (cyclic depth folding) across machines."""

__version__ = "0.1.0"
