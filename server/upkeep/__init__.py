"""Background upkeep: the janitor (what interrupted work left behind) and retention (what a
run's policy says to delete).
"""
