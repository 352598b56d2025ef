"""Privacy: what a neighbour on the ring can learn, and defences against it."""
