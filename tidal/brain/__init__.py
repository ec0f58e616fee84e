"""The brain: pure decisions over snapshots (no I/O, no clock). See tidal.brain.api."""
