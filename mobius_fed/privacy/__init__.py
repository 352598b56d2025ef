"""Privacy audit: what a neighbour on the ring, or the coordinator, can learn (the attacks).

The defences the attacks are run against live in :mod:`mobius_fed.defences`.
"""
