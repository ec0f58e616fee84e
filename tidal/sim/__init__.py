"""Discrete-event simulators that drive the brain's planners over traces."""
