"""tidal: elastic training for PyTorch. See README.md and the package map in DESIGN.md section 2."""

__version__ = "0.1.0"
