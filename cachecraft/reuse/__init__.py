"""cachecraft.reuse."""
