"""Lowering: the rewrites that execute what the analysis decided (redistributions, attention, positions,
masks, slices, losses), and the chunked loss."""
