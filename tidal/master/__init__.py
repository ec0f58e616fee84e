"""The job master: membership rounds, shards, journal, control plane (see job.py)."""
