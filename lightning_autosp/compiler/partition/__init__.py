"""Partitioning the joint graph for backward: SAC, the memory policies, offload, tiling, collective order."""
