"""A run's timeline: the file format (timeline, a leaf), its analysis (the phase table, the
bottleneck) and its pictures (views)."""
