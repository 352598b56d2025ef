"""The reference pages generated from the code (docs/reference/): every command's help, the
status schema, the Prometheus metrics and the settings table. ``python
scripts/gen_reference.py`` writes them; ``--check`` (and tests/test_reference.py) fails
when one is out of step with the code."""
