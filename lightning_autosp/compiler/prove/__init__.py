"""Proving a graph exact: every value's sequence layout, by a rule per op; every refusal is raised here."""
