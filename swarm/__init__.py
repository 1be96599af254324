"""swarm: SWARM-style decentralized pipeline training over hivemind.

The library is import-safe: no argparse, no printing, no environment changes at import.
Runnable roles live in the top-level ``peers`` package.
"""

__version__ = "0.1.0"
PROTOCOL_VERSION = 1
