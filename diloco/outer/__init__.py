"""The outer step: robust aggregation of the round's pseudo-gradients, the close's one pass
over the model, the guard that judges a step, its memory estimate.
"""
