"""The single-process reference engine (the oracle for the distributed ring)."""

from mobius_fed.engine.reference import EvalResult, ReferenceEngine, StepResult

__all__ = ["EvalResult", "ReferenceEngine", "StepResult"]
