"""Run docker/compose.yaml without Docker: every service a host in its own network namespace.

See :mod:`mobius_fed.testbed.netns` for the layout and ``mobius-fed testbed up`` for the
command-line tool.
"""

from mobius_fed.testbed.compose import ComposeError, ComposeProject, Service, load_compose
from mobius_fed.testbed.demo import coordinator_status, operator_certs, wait_for_run
from mobius_fed.testbed.namespaces import TestbedError, cleanup_stale, list_netns, netns_available
from mobius_fed.testbed.netns import Testbed

__all__ = [
    "ComposeError",
    "ComposeProject",
    "Service",
    "Testbed",
    "TestbedError",
    "cleanup_stale",
    "coordinator_status",
    "list_netns",
    "load_compose",
    "netns_available",
    "operator_certs",
    "wait_for_run",
]
