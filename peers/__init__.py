"""Peers: what each peer can do, and the live resource graph of a network or run.

Will own capability probing, signed capability records in the DHT and the resource graph with its
placement score (issue 3). Uses hivemind's DHT and swarm-independent signing helpers. Nothing is
exported yet.
"""
