"""The live web page of a run: what its stages, peers and trainers announce in the DHT, with history.

``state`` builds the page's data (``/api/state``) from a snapshot of records, ``history`` keeps the
bounded series the charts draw, ``join`` writes the command a volunteer pastes, ``poller`` reads the
DHT, ``server`` serves the page and its JSON over HTTP from the standard library, ``static`` holds
every asset the page loads (no CDN: the page works offline), ``metrics`` turns the same state into
Prometheus metrics (``swarm_dashboard_*``, with ``--metrics_port``).
"""
