"""Defences the training math runs: hop noise, private site layers, NoPeek, DP of the E/R.

Both engines import this package; nothing here imports an engine. What a neighbour or the
coordinator can still learn despite them is measured by :mod:`mobius_fed.privacy`.
"""
