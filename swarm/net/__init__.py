"""The network layer: calls between processes (p2pd streams and direct connections), the bytes they carry
(wire format, activation compression), and the addresses processes listen on, announce and dial."""
