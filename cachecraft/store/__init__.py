"""cachecraft.store."""
