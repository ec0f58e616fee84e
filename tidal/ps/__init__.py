"""tidal.ps: reserved for later issues (see DESIGN.md section 2)."""
