"""``diloco simulate``: the platform's algorithm, protocol and volunteers in one process, on
a simulated clock, for experiments and benchmarks.
"""
