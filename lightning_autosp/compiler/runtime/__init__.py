"""What runs: the collectives and ring attention as torch.library custom ops, and the ranks' agreement."""
