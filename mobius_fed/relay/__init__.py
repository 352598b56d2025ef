"""Ring edges for sites that only dial out: TCP tunnels below the workers' end-to-end mTLS.

``plan`` decides each edge's path (direct, reversed, relayed) from what every worker
declared; ``splice`` is the authenticated tunnel introduction and the byte pump;
``rendezvous`` pairs tunnels; ``tunnels`` holds a worker's two ends; ``daemon`` is
``mobius-relay``. See docs/reachability.md.
"""
