"""One ring training step as a deterministic event simulation: the model lives in
:mod:`mobius_fed.ops.step_sim` (``mobius-fed plan`` uses it too); this module keeps the
benchmarks' import (``from ring_step_sim import StepCosts, simulate_step``) working."""

from mobius_fed.ops.step_sim import (  # noqa: F401 - re-exported for the benchmarks
    BACKWARD,
    FORWARD,
    Op,
    StepCosts,
    simulate_step,
    worker_program,
)
