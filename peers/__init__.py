"""Runnable roles of the swarm: thin command-line front ends over the ``swarm`` library."""
