"""The profiler: measures every layer of a model file and writes a Profile.

This package's __init__ imports no torch so that the planner can read profiles
(`profiles.schema`) on a machine without torch.
"""
