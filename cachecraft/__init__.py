"""cachecraft: Cache-Craft chunk-cache reuse for retrieval-augmented generation."""
