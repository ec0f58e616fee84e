"""The API a training script uses: ``init()``, ``job.state(...)``, ``job.loader(...)``, ``job.step()``.

See tidal.worker.job for the loop and the README for a side-by-side with a torchrun script.
"""

from tidal.worker.api import WorkerGoneError
from tidal.worker.job import Job, init
from tidal.worker.loader import ElasticDataLoader
from tidal.worker.state import State

__all__ = ["ElasticDataLoader", "Job", "State", "WorkerGoneError", "init"]
