"""cachecraft.bench."""
