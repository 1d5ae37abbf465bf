"""The planner: hardware, cost model, the MILP and the search over parallel degrees.

Torch-free by design: it runs on a laptop without a GPU and reads only JSON documents.
"""
