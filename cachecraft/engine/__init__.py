"""cachecraft.engine."""
