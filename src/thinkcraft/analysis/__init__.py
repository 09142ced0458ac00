"""Analysis of finished runs: `thinkcraft compare` (compare.py) and its statistics (stats.py, after rliable)."""
