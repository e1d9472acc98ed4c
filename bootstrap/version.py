"""The release of Swarm's own code (every package of it), as peers advertise it and as `--require-swarm-version`
compares it; `swarm.__version__` is this."""

SWARM_VERSION = "0.1.0"
