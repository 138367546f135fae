"""Planning: per-rank memory, costs and model shapes; the planner and its command line."""
