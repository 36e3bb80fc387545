"""cachecraft.server."""
