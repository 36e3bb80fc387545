"""cachecraft.model."""
