"""Operations: federations and daemons run as supervised processes (docs/architecture.md §3)."""


class OpsError(Exception):
    """A failure to report to the operator as one line (the CLI exits with status 2)."""
