"""`corecap export`: a store's samples in a trainer's own files. One module per trainer owns its
layout and what it needs from a store (speculators.py, specforge.py; formats.py names them),
plan.py decides an export before anything is written, driver.py streams it (resumable), files.py
is what the layouts share; jsonl.py writes the samples as text, without states."""
